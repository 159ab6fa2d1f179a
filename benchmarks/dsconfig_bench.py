"""DeepSpeed config benchmark: how long `build`, `check` and `check --hf-trainer` take.

    python benchmarks/dsconfig_bench.py [--repeat 100]

Reported, not gated: timings on a shared machine vary too much to assert on (the tests keep only
a regression guard with a wide margin). Goals: build well under 10 ms, check under 100 ms once
DeepSpeed is imported; the HF fill is dominated by importing transformers the first time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from toolkit.dsconfig import Setup, build, check
    from toolkit.modelspec import read

    spec = read(ROOT / "ds_configs" / "models" / "llama-3-8b")
    setup = Setup(gpus=512, tp=8, pp=4, zero=1, micro_batch=1, global_batch=1024, schedule="megatron")
    config = build(setup, spec)
    public = ROOT / "tests" / "data" / "public_ds_configs" / "transformers-ds_config_zero3.json"

    start = time.perf_counter()
    check(config, gpus=512, tp=8, pp=4)
    first_check = time.perf_counter() - start
    start = time.perf_counter()
    check(public, gpus=8, hf_trainer=True)
    first_fill = time.perf_counter() - start

    print(f"build                  {per_call(lambda: build(setup, spec), args.repeat) * 1e3:8.3f} ms")
    print(f"check (first, imports) {first_check * 1e3:8.1f} ms")
    print(f"check                  {per_call(lambda: check(config, gpus=512, tp=8, pp=4), args.repeat) * 1e3:8.3f} ms")
    print(f"check --hf-trainer (first, imports transformers) {first_fill * 1e3:8.1f} ms")
    repeat = max(1, args.repeat // 10)
    print(f"check --hf-trainer     {per_call(lambda: check(public, gpus=8, hf_trainer=True), repeat) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
