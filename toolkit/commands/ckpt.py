"""`toolkit ckpt inspect DIR`: a training checkpoint's layout, progress, tensors and the layouts it resumes on."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect fine-tuning checkpoints")
    commands = p.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True)
    inspect = commands.add_parser("inspect", help="layout, step, samples/tokens seen, tensor shapes, resumable layouts",
                                  description="DIR: a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (its latest).")
    inspect.add_argument("dir")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    inspect.set_defaults(func=_inspect)


def _inspect(args) -> int:
    import json

    from toolkit.train.checkpoint_info import describe, lines

    info = describe(args.dir)
    print(json.dumps(info, indent=2) if args.json else "\n".join(lines(info)))
    return 0
