"""Pipeline bubble at PP=2, measured honestly: 1F1B and interleaved 1F1B (VPP=2) for m = 4, 8, 16
micro-batches, in one invocation.

The recipe runs with every micro-batch's forward and backward timed on every rank
(benchmarks/bubble_timed_recipe.py); each step's idle time per rank (step - its compute) is split
into the schedule's bubble, stage imbalance and p2p (benchmarks/bubble_replay.py), and the
bubble's share of the balanced step is printed against theory: (p-1)/(m+p-1) for 1F1B,
(p-1)/(V m+p-1) interleaved.

    python benchmarks/bubble_bench.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bubble_replay import Op, split_step, theory  # noqa: E402
from finetune_bench import MICRO, REPO, prepare, run_recipe  # noqa: E402

PP, WARMUP = 2, 2
SCRIPT = REPO / "benchmarks" / "bubble_timed_recipe.py"


def traced_run(root: Path, mc: Path, data: Path, m: int, vpp: int, steps: int) -> list:
    """Per-step splits of one PP=2 run (the first WARMUP steps left out)."""
    extra = (f"parallel.vpp={vpp}",)
    before = set(root.iterdir())
    run_recipe(root, mc, data, PP, steps, PP, MICRO * m, extra=extra, script=SCRIPT, warmup=0)
    (run_dir,) = set(root.iterdir()) - before
    traces = [json.loads((run_dir / f"pipeline_trace_rank{r}.json").read_text()) for r in range(PP)]
    splits = []
    for step in range(WARMUP, steps):
        ranks = [[Op(kind, stage, micro, start, end) for kind, stage, micro, s, start, end in t["ops"] if s == step]
                 for t in traces]
        window = (min(t["steps"][step][0] for t in traces), max(t["steps"][step][1] for t in traces))
        splits.append(split_step(ranks, window, PP * vpp))
    return splits


def report(name: str, m: int, vpp: int, splits: list) -> None:
    def med(field):
        return statistics.median(getattr(s, field) for s in splits)

    step = med("step")
    idle = [statistics.median(s.idle_per_rank[r] for s in splits) / step for r in range(PP)]
    print(f"  {name:<12} m={m:<3} step {step * 1e3:7.1f} ms | idle per stage {' '.join(f'{x:.3f}' for x in idle)} | "
          f"bubble {med('bubble') / step:.3f}  imbalance {med('imbalance') / step:.3f}  p2p {med('p2p') / step:.3f} "
          f"| balanced bubble {med('bubble_share_balanced'):.3f} vs theory {theory(PP, m, vpp):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bubble-bench-") as tmp:
        root = Path(tmp)
        hf, mc, data = prepare(root)
        runs = root / "runs"
        runs.mkdir()
        print(f"PP={PP}, 1 process per stage, micro-batch {MICRO}, medians over {args.steps - WARMUP} steps; "
              "shares of the measured step (bubble + imbalance + p2p = mean idle per stage)")
        for m in (4, 8, 16):
            for name, vpp in (("1F1B", 1), ("interleaved", 2)):
                report(name, m, vpp, traced_run(runs, mc, data, m, vpp, args.steps))


if __name__ == "__main__":
    main()
