"""Checkpoint save time with and without the layout-independent train/ state, in the same run
(issue 13: at a fixed layout, no more than 1.3x the save without it).

Every save of one fine-tuning run is done twice by benchmarks/save_worker.py: as it is (train/,
DeepSpeed's model-states file, model/) and as it was before train/ (DeepSpeed's files with its ZeRO
optimizer files, model/), the order alternating; printed: each save's seconds, the first save's
ratio and the geometric mean of the later ones' ratios. The default model is finetune_bench's (3.7 M
parameters, where fixed costs dominate); --hidden/--layers/--vocab give a larger one.

    python benchmarks/save_bench.py [--nprocs 2] [--tp 1] [--pp 1] [--zero 1] [--saves 7] [--hidden 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
GOAL = 1.3  # issue 13: save time with train/ <= 1.3x without


def run(root: Path, nprocs: int, tp: int, pp: int, zero: int, saves: int, model: dict) -> list[dict]:
    from finetune_bench import MICRO, MODEL, SEQ, prepare

    _, mc, data = prepare(root, model={**MODEL, **model})
    out = root / "saves.jsonl"
    overrides = [f"model.checkpoint={mc}", f"data.train_file={data}", f"data.seq_len={SEQ}", f"micro_batch={MICRO}",
                 f"global_batch={MICRO * nprocs // (tp * pp)}", f"steps={saves}", "save_every=1", "keep_last=1",
                 f"run_dir={root / 'run'}", "precision=fp32", "export_hf=false", f"parallel.tp={tp}",
                 f"parallel.pp={pp}", f"parallel.zero_stage={zero}", "resume=none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "SAVE_BENCH_OUT": str(out)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
                    str(REPO / "benchmarks" / "save_worker.py"), *overrides], env=env, check=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--hidden", type=int, help="hidden size (FFN 3x); default finetune_bench's 256")
    parser.add_argument("--layers", type=int, help="layers; default 4")
    parser.add_argument("--vocab", type=int, help="vocabulary; default 1024")
    args = parser.parse_args()
    model = {k: v for k, v in (("hidden_size", args.hidden), ("intermediate_size", args.hidden and 3 * args.hidden),
                               ("num_hidden_layers", args.layers), ("vocab_size", args.vocab)) if v}
    with tempfile.TemporaryDirectory() as tmp:
        records = run(Path(tmp), args.nprocs, args.tp, args.pp, args.zero, args.saves, model)
    for r in records:
        print(f"save at step {r['step']}: with train/ {r['with_s']:.2f} s (train/ itself {r['elastic_s']:.2f} s), "
              f"without {r['without_s']:.2f} s, ratio {r['with_s'] / r['without_s']:.2f}; rank 0 CPU "
              f"{r['with_cpu_s']:.2f} s / {r['without_cpu_s']:.2f} s, ratio {r['with_cpu_s'] / r['without_cpu_s']:.2f}")
    ratios = {}
    for clock in ("s", "cpu_s"):
        first, *later = (r[f"with_{clock}"] / r[f"without_{clock}"] for r in records)
        # The two saves of a step run in alternating order, and the first of a pair is the slower
        # (measured): the geometric mean of the pairs' ratios weighs both orders alike.
        later = statistics.geometric_mean(later)
        ratios[clock] = max(first, later)
        print(f"{'wall' if clock == 's' else 'rank 0 CPU'} time, TP {args.tp} x PP {args.pp} on {args.nprocs} processes, "
              f"ZeRO-{args.zero}: first save ratio {first:.2f}, later saves (geometric mean) {later:.2f} (goal <= {GOAL})")
    return 0 if ratios["s"] <= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
