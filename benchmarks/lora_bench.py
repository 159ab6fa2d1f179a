"""LoRA against full fine-tuning at the same layout, in one run: step time and peak memory.

Both are recipes/finetune.py on the same converted model, data, batch and layout (TP1 x PP1 x DP2,
ZeRO-1, fp32 on CPU); the LoRA run adds peft.enabled=true (r=16 on every linear). Per run: the
median step time after warm-up and rank 0's peak memory (the recipe's `peak_memory_bytes`: CUDA's
max allocated on a GPU, the process's peak resident set on CPU, where Python and the libraries
are part of it). Printed with `toolkit memory`'s estimate of the model states for each.

    python benchmarks/lora_bench.py [--repeats 2] [--steps 12]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from finetune_bench import SEQ, bench_args, data_parallel_processes, prepare  # noqa: E402

MICRO, GLOBAL_BATCH, WARMUP_STEPS = 4, 16, 3
LORA = ("peft.enabled=true", "peft.r=16", "peft.alpha=32")


def run_recipe(root: Path, mc: Path, data: Path, nprocs: int, steps: int, lora: bool) -> tuple[float, int]:
    """(median seconds per step after warm-up, rank 0's peak memory in bytes)."""
    run_dir = Path(tempfile.mkdtemp(dir=root))
    overrides = [f"model.checkpoint={mc}", f"data.train_file={data}", f"data.seq_len={SEQ}", f"micro_batch={MICRO}",
                 f"global_batch={GLOBAL_BATCH}", f"steps={steps}", "log_every=1", f"run_dir={run_dir}",
                 "precision=fp32", "export_hf=false", "save_every=0", "optim.warmup_steps=0", "resume=none",
                 *(LORA if lora else ())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs),
                    str(REPO / "recipes" / "finetune.py"), *overrides], env=env, check=True, capture_output=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [GLOBAL_BATCH * SEQ / r["padded_tokens_per_s"] for r in records[WARMUP_STEPS:]]
    return statistics.median(seconds), max(r["peak_memory_bytes"] for r in records)


def estimated_states(mc: Path, dp: int, lora: bool) -> int:
    """toolkit memory's model states (parameters + gradients + optimizer) per rank for the layout."""
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.dsconfig import Setup
    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.memory.lora import LoraShape

    spec = CheckpointMeta.read(mc).model_spec
    setup = Setup(gpus=dp, zero=1, precision="fp32", micro_batch=MICRO, global_batch=GLOBAL_BATCH, schedule="megatron")
    states = estimate(spec, setup, SEQ, kernels=CPU_LOCAL, reserve=0, lora=LoraShape(16) if lora else None).peak.states
    return states.params + states.grads + states.optimizer


def quiet() -> None:
    """Only the figures: the libraries' notices and progress bars say nothing about them."""
    from transformers.utils import logging as hf_logging

    from toolkit.runtime.distributed import choose_deepspeed_accelerator
    from toolkit.runtime.quiet import quiet_third_party

    quiet_third_party(verbose=False)
    choose_deepspeed_accelerator()
    hf_logging.disable_progress_bar()


def main() -> None:
    args = bench_args(__doc__, repeats=2, steps=12)
    quiet()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        root = Path(tmp)
        _, mc, data = prepare(root)
        dp = data_parallel_processes()
        runs = {"full": [], "lora": []}
        for _ in range(args.repeats):  # alternated, so that a change in machine load hits both alike
            for kind in runs:
                runs[kind].append(run_recipe(root, mc, data, dp, args.steps, kind == "lora"))
        step = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
        peak = {k: max(m for _, m in v) for k, v in runs.items()}
        states = {k: estimated_states(mc, dp, k == "lora") for k in runs}
        mib = 1 << 20
        print(f"TP1 x PP1 x DP{dp} ZeRO-1 fp32, global batch {GLOBAL_BATCH} x {SEQ} tokens, "
              f"{args.repeats} runs x {args.steps} steps each; LoRA: {' '.join(LORA[1:])} on every linear")
        for kind in runs:
            print(f"  {kind:<5} step median {step[kind] * 1e3:7.1f} ms  runs {[round(t * 1e3) for t, _ in runs[kind]]}"
                  f"  peak memory {peak[kind] / mib:7.1f} MiB  model states (estimate) {states[kind] / mib:6.1f} MiB")
        fastest = {k: min(t for t, _ in v) for k, v in runs.items()}  # the run least disturbed by other load
        print(f"  ratio LoRA / full: step time {step['lora'] / step['full']:.3f} (medians; fastest runs "
              f"{fastest['lora'] / fastest['full']:.3f}), peak memory {peak['lora'] / peak['full']:.3f}, "
              f"model states {states['lora'] / states['full']:.3f}")


if __name__ == "__main__":
    main()
