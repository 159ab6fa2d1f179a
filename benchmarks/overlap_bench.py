"""Communication/computation overlap on CPU: step time of recipes/finetune.py with DeepSpeed's
overlap_comm on and off (ZeRO-2 and ZeRO-3 at DP2, the recipe's defaults being on), runs
alternating in the same invocation, and FSDP2 (parallel.dp_engine=fsdp) beside ZeRO-3.

What it can show here: on the CPU accelerator DeepSpeed has no streams (Stream() is None and
resolves_data_dependency() is true), so overlap_comm changes only which code path buckets the
gradients, never runs a reduction beside the backward. A ratio near 1 is the expected result on
this machine; the overlap itself needs GPUs (benchmarks/gpu_suite.sh runs this script there).

    python benchmarks/overlap_bench.py [--repeats 3] [--steps 12]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_bench import MICRO, SEQ, bench_args, data_parallel_processes, prepare, run_recipe  # noqa: E402

GLOBAL_BATCH = 16
VARIANTS = {
    "ZeRO-2 overlap_comm on": ("parallel.zero_stage=2", "parallel.overlap_comm=true"),
    "ZeRO-2 overlap_comm off": ("parallel.zero_stage=2", "parallel.overlap_comm=false"),
    "ZeRO-3 overlap_comm on": ("parallel.zero_stage=3", "parallel.overlap_comm=true"),
    "ZeRO-3 overlap_comm off": ("parallel.zero_stage=3", "parallel.overlap_comm=false"),
    "FSDP2": ("parallel.dp_engine=fsdp",),
}
RATIOS = (("ZeRO-2 overlap_comm on", "ZeRO-2 overlap_comm off"), ("ZeRO-3 overlap_comm on", "ZeRO-3 overlap_comm off"),
          ("FSDP2", "ZeRO-3 overlap_comm on"))


def main() -> None:
    args = bench_args(__doc__, repeats=3, steps=12)
    dp = data_parallel_processes()
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        root = Path(tmp)
        _, mc, data = prepare(root)
        medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name, extra in VARIANTS.items():
                medians[name].append(statistics.median(run_recipe(root, mc, data, dp, args.steps, 1, GLOBAL_BATCH, extra)))
    print(f"step time, DP{dp} fp32, global batch {GLOBAL_BATCH} x {SEQ} tokens (micro-batch {MICRO}), "
          f"{args.repeats} runs x {args.steps} steps each, runs alternating:")
    for name, runs in medians.items():
        print(f"  {name:<26} median {statistics.median(runs) * 1e3:7.1f} ms  runs {[round(x * 1e3) for x in runs]}")
    for a, b in RATIOS:
        ratios = [x / y for x, y in zip(medians[a], medians[b])]
        print(f"  {a} / {b}: median {statistics.median(ratios):.3f}  (runs {[round(r, 3) for r in ratios]})")


if __name__ == "__main__":
    main()
