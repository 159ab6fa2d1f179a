"""MoE fine-tuning benchmark on CPU: tokens/s of a tiny Mixtral (8 experts, top-2) fine-tuned by
recipes/finetune.py at DP2 x EP2 against the same model, data and batch at DP2 x EP1, in the same
run (runs alternate), and the alltoall token dispatcher's share of the step time.

The dispatcher is timed inside the recipe (benchmarks/moe_timed_recipe.py): its forward methods
(permutation, all-to-alls, sort by local expert, and the inverses in combine) and the backward of
its all-to-all, summed over all steps, over the summed step times of the same steps.

    python benchmarks/moe_bench.py [--repeats 2] [--steps 12]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_bench import MICRO, SEQ, bench_args, prepare, run_recipe  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             num_local_experts=8, num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=256,
             sliding_window=None)
DP, GLOBAL_BATCH = 2, 16
TIMED = Path(__file__).resolve().parent / "moe_timed_recipe.py"


def timed_run(root: Path, mc: Path, data: Path, steps: int, ep: int) -> tuple[float, float]:
    """(tokens/s over the steps after warm-up, dispatcher seconds / step seconds over all steps)."""
    runs_before = set(root.iterdir())
    times = run_recipe(root, mc, data, DP, steps, 1, GLOBAL_BATCH, extra=(f"parallel.ep={ep}",), script=TIMED, warmup=0)
    run_dir = next(p for p in set(root.iterdir()) - runs_before if p.is_dir())
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("dispatcher_rank*.json"))]
    assert len(ranks) == DP and all(r["calls"] for r in ranks), ranks
    dispatcher = statistics.mean(r["forward"] + r["backward"] for r in ranks)
    return GLOBAL_BATCH * SEQ / statistics.median(times[3:]), dispatcher / sum(times)


def main() -> None:
    args = bench_args(__doc__, repeats=2, steps=12)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        root = Path(tmp)
        _, mc, data = prepare(root, "mixtral", MODEL)
        results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
        for _ in range(args.repeats):
            for ep in (1, 2):
                results[ep].append(timed_run(root, mc, data, args.steps, ep))
        print(f"tiny Mixtral ({MODEL['num_local_experts']} experts, top-{MODEL['num_experts_per_tok']}, hidden "
              f"{MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers), DP{DP} ZeRO-1 fp32, global batch "
              f"{GLOBAL_BATCH} x {SEQ} tokens, {args.repeats} runs x {args.steps} steps per EP:")
        for ep, rows in results.items():
            tokens = [t for t, _ in rows]
            shares = [s for _, s in rows]
            print(f"  EP{ep}: median {statistics.median(tokens):8.0f} tokens/s  runs {[round(t) for t in tokens]}; "
                  f"dispatcher {statistics.median(shares):.1%} of the step  runs {[f'{s:.1%}' for s in shares]}")
        ratios = [a[0] / b[0] for a, b in zip(results[2], results[1])]
        print(f"  tokens/s EP2 / EP1: median {statistics.median(ratios):.3f}  (runs {[round(r, 3) for r in ratios]})")


if __name__ == "__main__":
    main()
