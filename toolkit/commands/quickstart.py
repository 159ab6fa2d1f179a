"""`toolkit quickstart`: the built-in end-to-end example."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "quickstart",
        help="run the built-in example: tiny Llama -> TP2 x PP2 -> verify -> fine-tune -> HF -> generate",
        description="Create a tiny Llama and a digit-reversal task, convert the model to megatron-core TP=2 x PP=2, "
        "check its logits against HF on 4 processes, fine-tune it with recipes/finetune.py (megatron-core TP/PP + "
        "DeepSpeed ZeRO-1), export it to HF and check that greedy generation answers >= 90% of held-out "
        "prompts. Runs on CPU in a few minutes.",
    )
    p.add_argument("--workdir", default="quickstart_out", help="where to put the example files (default ./quickstart_out)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's 300)")
    p.add_argument("--lora", action="store_true",
                   help="then train a LoRA adapter on the fine-tuned model for a second task (reversed digits + 1) "
                   "and check the merged model on its held-out prompts")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit.quickstart import run

    run(args.workdir, steps=args.steps, lora=args.lora)
    return 0
