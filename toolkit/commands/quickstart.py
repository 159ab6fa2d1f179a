"""`toolkit quickstart`: the built-in end-to-end example."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "quickstart",
        help="run the built-in example: tiny Llama -> TP2 x PP2 -> verify -> back to HF",
        description="Create a tiny Llama, convert it to megatron-core TP=2 x PP=2, compare logits with HF "
        "on 4 processes, and convert it back bit-exactly. Runs on CPU in about a minute.",
    )
    p.add_argument("--workdir", default="quickstart_out", help="where to put the example files (default ./quickstart_out)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit.quickstart import run

    run(args.workdir)
    return 0
