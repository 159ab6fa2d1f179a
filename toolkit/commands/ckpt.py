"""`toolkit ckpt inspect DIR` (a training checkpoint's layout, progress, tensors and the layouts it
resumes on) and `toolkit ckpt reshard DIR OUT --tp --pp [--ep]` (the checkpoint rewritten for another layout)."""

from __future__ import annotations

from toolkit.commands.convert import positive_int


def register(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect or reshard fine-tuning checkpoints")
    commands = p.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True)
    inspect = commands.add_parser("inspect", help="layout, step, samples/tokens seen, tensor shapes, resumable layouts",
                                  description="DIR: a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (its latest).")
    inspect.add_argument("dir")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    inspect.set_defaults(func=_inspect)
    reshard = commands.add_parser(
        "reshard", help="rewrite a checkpoint for another TP x PP, offline",
        description="DIR: a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (its latest). OUT: a new run "
                    "directory holding that checkpoint for TP x PP (model/ rewritten one rank file at a time, the "
                    "layout-independent train/ state copied); continue it with run_dir=OUT resume=auto on any DP and "
                    "ZeRO stage. OUT appears only when complete.")
    reshard.add_argument("dir")
    reshard.add_argument("out")
    reshard.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size of the output")
    reshard.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel size of the output")
    reshard.add_argument("--ep", type=positive_int, help="expert-parallel size of the output (MoE models; "
                         "default: the checkpoint's)")
    reshard.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    reshard.set_defaults(func=_reshard)


def _inspect(args) -> int:
    import json

    from toolkit.train.checkpoint_info import describe, lines

    info = describe(args.dir)
    print(json.dumps(info, indent=2) if args.json else "\n".join(lines(info)))
    return 0


def _reshard(args) -> int:
    from toolkit.train.reshard import reshard

    out = reshard(args.dir, args.out, args.tp, args.pp, overwrite=args.overwrite, ep=args.ep)
    ep = f" x EP {args.ep}" if args.ep else ""
    print(f"wrote {out} at TP {args.tp} x PP {args.pp}{ep}: continue it with run_dir={out} resume=auto")
    return 0
