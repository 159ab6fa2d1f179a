"""Fine-tuning benchmark on CPU, all in one run:

1. Step time of our recipe at TP1 x PP1 x DP2 (ZeRO-1, megatron-core schedule) against a plain
   HF model wrapped by DeepSpeed ZeRO-1 (engine.backward/step per micro-batch), same model, the
   same batches (the recipe's own data order) and the same DeepSpeed reduce bucket: ratio of
   medians, with the spread over repeated runs; and ours at TP2 on the same processes against HF
   at DP1. Goal (reported, not gated): <= 1.05.
2. Where the step's time goes on both sides, by wall clock (benchmarks/step_phases.py: forward,
   loss, backward, waiting for the other rank, DeepSpeed's reduction and step, our own
   collective and loop; the forward by module class), then torch.profiler's per-op tables
   (benchmarks/step_profile.py), which tell which ops run but inflate some of their times.
The pipeline bubble is benchmarks/bubble_bench.py: it times every micro-batch on every rank and
tells the bubble apart from p2p and stage imbalance (this file's earlier estimate, 1 - m x the PP=1
stage time / the PP=2 step, counted all three as bubble).

    python benchmarks/finetune_bench.py [--repeats 3] [--steps 20]

`--size 1b --precision bf16 --seq 2048 --json OUT` is the GPU suite's benchmark
(benchmarks/gpu_suite.py): ours against HF + DeepSpeed at a size that keeps a GPU busy, step
time, MFU and peak memory of both sides, written as JSON, without the phase and op profiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=1024, max_position_embeddings=256)
SEQ, MICRO = 128, 4
# About 1.0e9 parameters (Llama shapes): what the GPU suite benchmarks at sequence 2048.
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
SIZES = {"tiny": MODEL, "1b": ONE_B}


@dataclass(frozen=True)
class Shape:
    """What one comparison runs: tokens per row, rows per micro-batch, and the precision of both sides."""
    seq: int = SEQ
    micro: int = MICRO
    precision: str = "fp32"


def prepare(root: Path, variant: str = "llama", model: dict | None = None, seq: int = SEQ,
            dtype: str = "float32") -> tuple[Path, Path, Path]:
    """The HF model (saved in `dtype`: bfloat16 halves what a 1B model writes and converts), its
    torch_dist conversion, and 512 documents of `seq` + 2 characters (one token each with the tiny
    tokenizer: every row is full, so padded and real tokens agree)."""
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, root / "hf", dtype=dtype, **(MODEL if model is None else model))
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", vocab_divisor=1, progress=False)
    data = root / "data.jsonl"
    text = ("0123456789" * (seq // 10 + 1))[:seq + 2]
    data.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(512)))
    return hf, mc, data


def run_recipe(root: Path, mc: Path, data: Path, nprocs: int, steps: int, pp: int, global_batch: int,
               extra: tuple[str, ...] = (), script: Path = REPO / "recipes" / "finetune.py",
               warmup: int = 3, script_args: tuple[str, ...] = (), shape: Shape = Shape()) -> list[float]:
    """Per-step seconds (after `warmup` steps) of recipes/finetune.py (or of `script`, which runs
    it, given `script_args` before the overrides), with `extra` overrides."""
    return [global_batch * shape.seq / r["padded_tokens_per_s"]
            for r in recipe_metrics(root, mc, data, nprocs, steps, pp, global_batch, extra, script, script_args, shape)[warmup:]]


def recipe_metrics(root: Path, mc: Path, data: Path, nprocs: int, steps: int, pp: int, global_batch: int,
                   extra: tuple[str, ...] = (), script: Path = REPO / "recipes" / "finetune.py",
                   script_args: tuple[str, ...] = (), shape: Shape = Shape()) -> list[dict]:
    """The recipe's logged metrics, one record per step."""
    run_dir = Path(tempfile.mkdtemp(dir=root))
    overrides = [f"model.checkpoint={mc}", f"data.train_file={data}", f"data.seq_len={shape.seq}",
                 f"micro_batch={shape.micro}", f"global_batch={global_batch}", f"steps={steps}", "log_every=1",
                 f"run_dir={run_dir}", f"precision={shape.precision}", "export_hf=false", "save_every=0",
                 f"parallel.pp={pp}", "optim.warmup_steps=0", "resume=none", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nprocs), str(script), *script_args, *overrides], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the recipe failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hf_deepspeed_worker(hf_dir: str, data: str, steps: int, global_batch: int, profile_out: str | None = None,
                        phases_out: str | None = None, shape: dict | None = None) -> dict:
    """Baseline: HF LlamaForCausalLM under DeepSpeed ZeRO-1, DeepSpeed's own accumulation
    (optionally profiled: benchmarks/step_profile.py, or timed by phase: benchmarks/step_phases.py).
    It trains on the recipe's own batches, the same rows in the same order, with the same masked
    cross entropy, so that both sides compute the same thing. In bf16, DeepSpeed's bf16 mode (bf16
    weights and activations, fp32 master weights and moments), as the recipe's.
    Returns the step times after 3 warm-up steps and this rank's peak memory."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.runtime.cpu_compat import skip_deepspeed_shm_op
    from toolkit.train.build import TORCH_ADAM
    from toolkit.train.metrics import peak_memory_bytes

    shape = Shape(**(shape or {}))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        skip_deepspeed_shm_op()
    else:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    dp = torch.distributed.get_world_size()
    gas = global_batch // (shape.micro * dp)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    timer = None
    if phases_out:
        from step_phases import BACKWARD_CLASSES, PhaseTimer, time_deepspeed

        timer = PhaseTimer()
        time_deepspeed(timer)
        timer.hook_modules(model)
        timer.hook_backward(model, BACKWARD_CLASSES["hf"])
        model.forward = timer.wrap("forward", model.forward)
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": shape.micro, "gradient_accumulation_steps": gas,
              "bf16": {"enabled": shape.precision == "bf16"},
              "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": TORCH_ADAM}}}  # as ours
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = recipe_batches(hf_dir, data, global_batch, dp, torch.distributed.get_rank(), shape)

    def masked_loss(logits, batch):
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].to(device).flatten(),
                                                   reduction="none")
        mask = batch["loss_mask"].to(device).flatten()
        return (losses * mask).sum() / mask.sum()

    backward = engine.backward
    if timer:
        masked_loss, backward = timer.wrap("loss", masked_loss), timer.wrap("backward", engine.backward)

    def train_step():
        for batch in batches.next_global_batch():
            backward(masked_loss(engine(input_ids=batch["tokens"].to(device)).logits, batch))
            engine.step()

    if timer:
        train_step = timer.wrap_step(train_step)
    if profile_out:
        from step_profile import profiled

        train_step = profiled(train_step, Path(profile_out))
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the recipe's step ends in .item() of the loss: a sync too
        times.append(time.perf_counter() - began)
    if timer and torch.distributed.get_rank() == 0:
        Path(phases_out).write_text(json.dumps(timer.summary()))
    return {"times": times[3:], "peak_memory_bytes": peak_memory_bytes(device)}


def recipe_batches(hf_dir: str, data: str, global_batch: int, dp: int, dp_rank: int, shape: Shape = Shape()):
    """The recipe's batch source at its defaults (toolkit/train/build.py)."""
    from transformers import AutoTokenizer

    from toolkit.train.config import DataConfig, TrainConfig
    from toolkit.train.data import BatchSource, load_rows

    d = DataConfig()
    rows, _ = load_rows(data, AutoTokenizer.from_pretrained(hf_dir), shape.seq, d.pack, d.overlong, d.malformed)
    return BatchSource(rows, global_batch, shape.micro, dp, dp_rank, TrainConfig.seed, d.shuffle, d.pack)


def run_baseline(hf: Path, data: Path, nprocs: int, steps: int, global_batch: int,
                 profile_out: Path | None = None, phases_out: Path | None = None) -> list[float]:
    return baseline_run(hf, data, nprocs, steps, global_batch, profile_out, phases_out)["times"]


def baseline_run(hf: Path, data: Path, nprocs: int, steps: int, global_batch: int, profile_out: Path | None = None,
                 phases_out: Path | None = None, shape: Shape = Shape()) -> dict:
    """Rank 0's step times and peak memory."""
    from toolkit.runtime.launch import run_on_processes

    sys.path.insert(0, str(Path(__file__).parent))
    return run_on_processes("finetune_bench:hf_deepspeed_worker", nprocs, str(hf), str(data), steps, global_batch,
                            *(None if out is None else str(out) for out in (profile_out, phases_out)), asdict(shape))[0]


# DeepSpeed's default reduce bucket, which the baseline runs with; the recipe's generated config uses
# hidden_size^2 elements (HF's "auto"), 65536 here, and so 19 reductions a step instead of 1.
SAME_BUCKET = ("parallel.reduce_bucket_size=500000000",)


def step_ratio(root: Path, hf: Path, mc: Path, data: Path, repeats: int, steps: int, dp: int, tp: int) -> None:
    """Ours at TP tp x DP dp against HF + DeepSpeed at DP dp, same global batch, alternating runs."""
    ours, base = [], []
    for _ in range(repeats):
        ours.append(statistics.median(run_recipe(root, mc, data, dp * tp, steps, 1, 16, (f"parallel.tp={tp}", *SAME_BUCKET))))
        base.append(statistics.median(run_baseline(hf, data, dp, steps, 16)))
    ratios = [o / b for o, b in zip(ours, base)]
    print(f"step time, ours TP{tp} x PP1 x DP{dp} vs HF + DeepSpeed DP{dp} (ZeRO-1), global batch 16 x {SEQ} tokens, "
          f"{repeats} runs x {steps} steps:")
    print(f"  ours (megatron-core + DeepSpeed)  median {statistics.median(ours) * 1e3:7.1f} ms  runs {[round(x * 1e3) for x in ours]}")
    print(f"  HF + DeepSpeed ZeRO-1             median {statistics.median(base) * 1e3:7.1f} ms  runs {[round(x * 1e3) for x in base]}")
    print(f"  ratio ours/baseline               median {statistics.median(ratios):.3f}  (min {min(ratios):.3f}, max {max(ratios):.3f}; goal <= 1.05)")


def compare(root: Path, hf: Path, mc: Path, data: Path, steps: int, global_batch: int, shape: Shape,
            warmup: int = 3, processes: int | None = None) -> dict:
    """Ours at TP1 x PP1 (DP = the processes) against HF + DeepSpeed ZeRO-1 on the same batches and
    processes: median step time, MFU and rank 0's peak memory of each side. Both MFUs count the same
    FLOPs (the recipe's 6N + attention estimate of the real tokens, toolkit/train/metrics.py) against
    the same peak, so their ratio is the inverse ratio of step times."""
    dp = processes or data_parallel_processes()
    logged = recipe_metrics(root, mc, data, dp, steps, 1, global_batch, SAME_BUCKET, shape=shape)
    ours = logged[warmup:]
    ours_s = statistics.median(global_batch * shape.seq / r["padded_tokens_per_s"] for r in ours)
    ours_mfu = statistics.median(r["mfu"] for r in ours) if ours[0].get("mfu") is not None else None
    base = baseline_run(hf, data, dp, steps, global_batch, shape=shape)
    base_s = statistics.median(base["times"][warmup - 3:])  # the worker drops its first 3 itself
    return {"shape": {**asdict(shape), "global_batch": global_batch, "processes": dp, "steps_timed": len(ours)},
            "ours": {"step_s": ours_s, "mfu": ours_mfu, "tflops_per_device": statistics.median(r["tflops_per_device"] for r in ours),
                     "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ours), "losses": [r["loss"] for r in logged]},
            "hf_deepspeed": {"step_s": base_s, "mfu": None if ours_mfu is None else ours_mfu * ours_s / base_s,
                             "peak_memory_bytes": base["peak_memory_bytes"]},
            "step_time_ratio": ours_s / base_s}


def print_profiles(root: Path, hf: Path, mc: Path, data: Path, dp: int) -> None:
    """One profiled run each side (rank 0, steps FIRST.. of benchmarks/step_profile.py)."""
    from step_profile import COUNT, FIRST

    ours_out, base_out = root / "profile-ours.txt", root / "profile-hf.txt"
    run_recipe(root, mc, data, dp, FIRST + COUNT, 1, 16, SAME_BUCKET, script=Path(__file__).parent / "step_profile.py",
               script_args=(str(ours_out),), warmup=0)
    run_baseline(hf, data, dp, FIRST + COUNT, 16, base_out)
    for title, path in (("ours (megatron-core + DeepSpeed)", ours_out), ("HF + DeepSpeed", base_out)):
        print(f"op profile (torch.profiler self CPU time, which inflates some ops), rank 0, {COUNT} steps at DP{dp}: {title}")
        print(path.read_text())


def write_profiles(root: Path, hf: Path, mc: Path, data: Path, global_batch: int, shape: Shape, out: Path) -> None:
    """Both sides' op tables at `shape` on the compared processes, to out/profile-{ours,hf}.txt."""
    from step_profile import COUNT, FIRST

    out.mkdir(parents=True, exist_ok=True)
    dp = data_parallel_processes()
    run_recipe(root, mc, data, dp, FIRST + COUNT, 1, global_batch, SAME_BUCKET, script=Path(__file__).parent / "step_profile.py",
               script_args=(str(out / "profile-ours.txt"),), warmup=0, shape=shape)
    baseline_run(hf, data, dp, FIRST + COUNT, global_batch, out / "profile-hf.txt", shape=shape)
    for name in ("profile-ours.txt", "profile-hf.txt"):
        print(f"{name}:\n{(out / name).read_text()}")


def print_phases(root: Path, hf: Path, mc: Path, data: Path, dp: int, steps: int) -> None:
    """Where the step time goes, both sides, by wall clock (benchmarks/step_phases.py)."""
    from step_phases import FIRST, phase_table

    ours_out, base_out = root / "phases-ours.json", root / "phases-hf.json"
    run_recipe(root, mc, data, dp, steps, 1, 16, SAME_BUCKET, script=Path(__file__).parent / "step_phases.py",
               script_args=(str(ours_out),), warmup=0)
    run_baseline(hf, data, dp, steps, 16, phases_out=base_out)
    ours, base = (json.loads(p.read_text()) for p in (ours_out, base_out))
    print(f"step phases by wall clock, rank 0, mean of steps {FIRST}..{steps} at TP1 x PP1 x DP{dp}:")
    print(phase_table(ours, base))


def data_parallel_processes() -> int:
    """2 processes on CPU; on GPUs one per GPU, at most 2 (a one-GPU machine compares at DP1)."""
    import torch

    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def bench_parser(doc: str, repeats: int, steps: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--steps", type=int, default=steps)
    return parser


def bench_args(doc: str, repeats: int, steps: int) -> argparse.Namespace:
    return bench_parser(doc, repeats, steps).parse_args()


def main() -> None:
    parser = bench_parser(__doc__, repeats=3, steps=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--micro", type=int, default=MICRO)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, help="one comparison (`compare`) written here; no profiles")
    parser.add_argument("--profile-dir", type=Path,
                        help="with --json: also both sides' op profiles (benchmarks/step_profile.py) at that shape, here")
    args = parser.parse_args()
    if args.json:
        shape = Shape(args.seq, args.micro, args.precision)
        with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
            root = Path(tmp)
            hf, mc, data = prepare(root, model=SIZES[args.size], seq=args.seq,
                                   dtype="bfloat16" if args.precision == "bf16" else "float32")
            result = compare(root, hf, mc, data, args.steps, args.global_batch, shape)
            result["size"] = args.size
            args.json.write_text(json.dumps(result, indent=1))
            print(json.dumps(result, indent=1))
            if args.profile_dir:
                write_profiles(root, hf, mc, data, args.global_batch, shape, args.profile_dir)
        return
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        root = Path(tmp)
        hf, mc, data = prepare(root)
        dp = data_parallel_processes()
        step_ratio(root, hf, mc, data, args.repeats, args.steps, dp, tp=1)
        if dp == 2:  # TP2 on the same two devices, against HF on one
            step_ratio(root, hf, mc, data, args.repeats, args.steps, 1, tp=2)
        print_phases(root, hf, mc, data, dp, args.steps)
        print_profiles(root, hf, mc, data, dp)


if __name__ == "__main__":
    main()
