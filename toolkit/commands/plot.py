"""`toolkit plot RUN_DIR`: loss curves to a PNG."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw a fine-tuning run's loss curves to a PNG",
                       description="Read RUN_DIR/metrics.jsonl and draw loss and eval loss to RUN_DIR/loss.png "
                                   "(needs matplotlib: pip install 'megatron-ds-toolkit[plot]').")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/loss.png)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit.train.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0
