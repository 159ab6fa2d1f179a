"""The one-command GPU suite: one unattended run on a fresh GPU node, one verdict.

    bash benchmarks/gpu_suite.sh OUTDIR [--dry] [--wheelhouse DIR] [--budget-s S]

Stages, in order, each in a process of its own with its own time limit, so that a crash, a hang or
a failed assertion in one is recorded and the next still runs:

    install      pip install --no-index from the wheelhouse (with --wheelhouse); torch must stay in place
    env          GPU, driver, CUDA, torch, nvcc, Transformer Engine, DeepSpeed ops, the layer spec chosen
    smoke        one training step of the recipe, saved and exported to HF
    gpu_tests    pytest -m gpu
    parity_fp32  10 steps against the HF reference on the same device, fp32 with TF32 off:
                 losses within 1e-5, gradient norms within 1e-4 relative
    parity_bf16  the same in bf16 against the fp32 reference: losses and gradient norms compared
    resume       the fp32 run again, SIGKILLed in its second save, resumed: steps 6..10 bit-exact
    bench        ours against HF + DeepSpeed, bf16, ~1B parameters at sequence 2048: step time,
                 MFU and peak memory of both (benchmarks/finetune_bench.py)
    fp8          the bench's model, batches and steps again in FP8 (tensorwise): step time, MFU and
                 peak memory against the bench's bf16 run, and the area under the loss curve within
                 1% of bf16's (Megatron-LM's FP8 criterion)

OUTDIR receives exactly two files: summary.json (rewritten after every stage, so a run cut short
still tells what passed) and suite.log (every stage's output). `--dry` runs every stage that can
run on CPU, at tiny sizes; CI runs it (tests/test_gpu_suite.py). A GPU is never required: without
one the stages run on CPU and gpu_tests reports its tests as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "GPU_SUITE_RESULT "
STEPS = 10
# fp32 runs: TF32 off in cuBLAS (matmuls) and cuDNN, deterministic kernels for the bit-exact resume.
EXACT_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict = field(default_factory=dict)


def stage_table(work: Path, dry: bool, wheelhouse: Path | None) -> list[Stage]:
    """Every stage runs this file again with --stage NAME (install runs pip itself)."""
    me = [sys.executable, str(Path(__file__).resolve()), "--work", str(work), *(["--dry"] if dry else []), "--stage"]
    stages = []
    if wheelhouse is not None:
        stages.append(Stage("install", [*me, "install", "--wheelhouse", str(wheelhouse)], 180))
    stages += [
        Stage("env", [*me, "env"], 90),
        Stage("smoke", [*me, "smoke"], 240),
        Stage("gpu_tests", [*me, "gpu_tests"], 300),
        Stage("parity_fp32", [*me, "parity_fp32"], 240, EXACT_ENV),
        Stage("parity_bf16", [*me, "parity_bf16"], 240),
        Stage("resume", [*me, "resume"], 300, EXACT_ENV),
        Stage("bench", [*me, "bench"], 420),
        Stage("fp8", [*me, "fp8"], 300),
    ]
    return stages


def run_suite(outdir: Path, stages: list[Stage], budget_s: float, dry: bool) -> dict:
    """Run the stages in order, each limited to its own time and to what is left of `budget_s`;
    record each one's outcome in OUTDIR/summary.json as soon as it ends."""
    outdir.mkdir(parents=True, exist_ok=True)
    log = outdir / "suite.log"
    log.write_text("")
    summary = {"dry": dry, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budget_s,
               "stages": {s.name: {"status": "pending"} for s in stages}}
    deadline = time.monotonic() + budget_s
    for stage in stages:
        left = deadline - time.monotonic()
        if left < 5:
            summary["stages"][stage.name] = {"status": "skipped", "reason": "the suite's time budget is spent"}
            continue
        summary["stages"][stage.name] = run_stage(stage, min(stage.timeout_s, left), log)
        write_summary(outdir, summary)
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for status in ("passed", "failed", "skipped"):
        summary[status] = [name for name, s in summary["stages"].items() if s["status"] == status]
    write_summary(outdir, summary)
    return summary


def run_stage(stage: Stage, timeout_s: float, log: Path) -> dict:
    began = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n===== {stage.name} (limit {timeout_s:.0f} s) =====\n")
        out.flush()
        env = {**os.environ, **stage.env, "PYTHONUNBUFFERED": "1"}
        # A session of its own, so that a timeout kills the stage's launchers and ranks too.
        proc = subprocess.Popen(stage.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO, start_new_session=True)
        result, timed_out = None, False
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
        for line in output.splitlines():
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
            else:
                out.write(line + "\n")
    record = {"seconds": round(time.monotonic() - began, 1), "exit_code": proc.returncode}
    if timed_out:
        return {**record, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s"}
    if result is None:
        tail = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        return {**record, "status": "failed", "reason": f"exit {proc.returncode}: {tail[0][:300]}"}
    # a stage says it did not apply with "stage_skipped" (gpu_tests' own "skipped" is pytest's count of skipped tests)
    status = "skipped" if result.pop("stage_skipped", False) else ("passed" if result.pop("ok") and proc.returncode == 0 else "failed")
    return {**record, "status": status, **result}


def write_summary(outdir: Path, summary: dict) -> None:
    partial = outdir / ".summary.json.partial"
    partial.write_text(json.dumps(summary, indent=1))
    partial.replace(outdir / "summary.json")


# ---- the stages (each runs in its own process and prints one RESULT line) ----

def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def stage_install(work: Path, dry: bool, wheelhouse: str) -> dict:
    """The offline install (docs/install.md): nothing from an index, the site's torch left in place."""
    probe = [sys.executable, "-c", "import torch, json; print(json.dumps([torch.__version__, torch.__file__]))"]
    before = json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "--no-build-isolation",
           "-e", str(REPO)]
    done = subprocess.run(pip, text=True)
    after = json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)
    size = sum(p.stat().st_size for p in Path(wheelhouse).iterdir())
    return {"ok": done.returncode == 0 and before == after, "torch_before": before, "torch_after": after,
            "wheelhouse_bytes": size, "pip_exit": done.returncode}


def stage_env(work: Path, dry: bool) -> dict:
    import importlib
    import platform
    import shutil

    import torch

    from toolkit.model import running_layer_spec

    report: dict = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                    "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                      capability=f"{props.major}.{props.minor}")
    smi = shutil.which("nvidia-smi")
    if smi:
        query = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        report["driver"] = query.stdout.strip() or query.stderr.strip()[:200]
    nvcc = shutil.which("nvcc")
    report["nvcc"] = (subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
                      or ["?"])[-1] if nvcc else None
    from torch.utils.cpp_extension import CUDA_HOME

    report["cuda_home"] = CUDA_HOME
    for module, key in (("transformer_engine.pytorch", "transformer_engine"),
                        ("megatron.core.extensions.transformer_engine", "megatron_te_extension")):
        try:
            importlib.import_module(module)
            report[key] = "imports"
        except Exception as error:  # any failure to import is the answer here, not a crash
            report[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    report["layer_spec"] = running_layer_spec()
    report["deepspeed_ops"] = deepspeed_ops()
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("transformers", "megatron-core", "deepspeed", "accelerate", "peft", "safetensors", "wandb", "pydantic"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    report["packages"] = packages
    print(json.dumps(report, indent=1))
    return {"ok": True, **report}


def deepspeed_ops() -> dict:
    """Which DeepSpeed ops came prebuilt and which could be JIT-built here (FusedAdam needs nvcc)."""
    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

    ops = {"version": deepspeed.__version__,
           "prebuilt": sorted(k for k, v in deepspeed.git_version_info.installed_ops.items() if v)}
    for builder in (FusedAdamBuilder, CPUAdamBuilder):
        try:
            ops[builder.NAME] = "compatible" if builder().is_compatible(verbose=False) else "not compatible"
        except Exception as error:  # a builder that cannot even probe is reported, not raised
            ops[builder.NAME] = f"{type(error).__name__}: {error}"[:200]
    return ops


def tiny(work: Path):
    """The tiny model, its conversion and the data, made once per suite run and shared by the stages."""
    from tests.finetune_harness import write_uneven_data
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = work / "tiny"
    if not (root / "done").exists():
        root.mkdir(parents=True, exist_ok=True)
        hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
        hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
        write_uneven_data(root / "data.jsonl", 300)
        (root / "done").write_text("")
    return root / "hf", root / "mc", root / "data.jsonl"


def fresh(path: Path) -> Path:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def stage_smoke(work: Path, dry: bool) -> dict:
    from tests.finetune_harness import launch, read_metrics, recipe

    hf, mc, data = tiny(work)
    run = fresh(work / "smoke")
    launch(1, recipe(run, mc, data, steps=1, save_every=1, export_hf=True))
    metrics = read_metrics(run / "run")
    saved = (run / "run" / "checkpoints" / "latest").exists()
    exported = any((run / "run").rglob("*.safetensors"))
    return {"ok": len(metrics) == 1 and saved and exported, "loss": metrics[0]["loss"] if metrics else None,
            "checkpoint_saved": saved, "hf_exported": exported, "device": device_name()}


def stage_gpu_tests(work: Path, dry: bool) -> dict:
    """`pytest -m gpu`; in a dry run only tests/test_gpu.py (collected and skipped), which keeps it cheap."""
    import torch
    import xml.etree.ElementTree as ElementTree

    junit = work / "gpu-tests.xml"
    targets = ["tests/test_gpu.py"] if dry else ["tests"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *targets]
    done = subprocess.run(cmd, cwd=REPO)
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    if not torch.cuda.is_available():
        return {"ok": done.returncode == 0, "stage_skipped": True, "reason": "no CUDA device: every gpu test skips", **counts}
    return {"ok": done.returncode == 0 and counts["tests"] > counts["skipped"], "pytest_exit": done.returncode, **counts}


def parity(work: Path, name: str, **overrides) -> dict:
    """The recipe at TP1 x PP1 on one device against the HF reference (tests/finetune_harness.py)
    on the same device, fp32; saving every 5 steps so that the resume stage can reuse the fp32 run."""
    import torch

    from tests.finetune_harness import differences, hf_reference, launch, read_metrics, recipe

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf, mc, data = tiny(work)
    run = fresh(work / name)
    cfg = recipe(run, mc, data, save_every=5, parallel={"tp": 1, "pp": 1, "zero_stage": 1}, **overrides)
    launch(1, cfg)
    metrics = read_metrics(run / "run")
    (work / f"{name}-metrics.json").write_text(json.dumps(metrics))
    # one fp32 reference serves both precisions (the reference reads neither precision nor save_every)
    cached = work / "reference.json"
    if not cached.exists():
        cached.write_text(json.dumps(hf_reference(hf, data, cfg, STEPS, device=device_name())))
    ref_losses, ref_norms = json.loads(cached.read_text())
    loss, norm = differences(metrics, ref_losses, ref_norms)  # the tests' measure: absolute loss, relative norm
    return {"steps": len(metrics), "max_loss_diff": loss, "max_grad_norm_rel_diff": norm,
            "losses": [m["loss"] for m in metrics], "reference_losses": ref_losses,
            "grad_norms": [m["grad_norm"] for m in metrics], "reference_grad_norms": ref_norms}


def stage_parity_fp32(work: Path, dry: bool) -> dict:
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32

    result = parity(work, "fp32")
    ok = (result["steps"] == STEPS and result["max_loss_diff"] < LOSS_TOLERANCE_FP32
          and result["max_grad_norm_rel_diff"] <= GRAD_NORM_TOLERANCE)
    return {"ok": ok, "loss_tolerance": LOSS_TOLERANCE_FP32, "grad_norm_rel_tolerance": GRAD_NORM_TOLERANCE, **result}


def stage_parity_bf16(work: Path, dry: bool) -> dict:
    from tests.finetune_harness import GRAD_NORM_TOLERANCE_BF16, LOSS_TOLERANCE_BF16

    result = parity(work, "bf16", precision="bf16")
    ok = (result["steps"] == STEPS and result["max_loss_diff"] < LOSS_TOLERANCE_BF16
          and result["max_grad_norm_rel_diff"] <= GRAD_NORM_TOLERANCE_BF16)
    return {"ok": ok, "loss_tolerance": LOSS_TOLERANCE_BF16, "grad_norm_rel_tolerance": GRAD_NORM_TOLERANCE_BF16, **result}


def stage_resume(work: Path, dry: bool) -> dict:
    """The parity_fp32 run again (the same recipe), paused inside its second save (step 10, shards
    written, no marker yet) and SIGKILLed with every rank; resume=auto must go on from step 5 and
    repeat the uninterrupted run's steps 6..10 exactly."""
    from tests.finetune_harness import kill_tree, launch, read_metrics, recipe, wait_for

    straight_file = work / "fp32-metrics.json"
    if not straight_file.exists():  # parity_fp32 did not get as far as its run: make the uninterrupted one here
        hf, mc, data = tiny(work)
        straight_run = fresh(work / "fp32")
        launch(1, recipe(straight_run, mc, data, save_every=5, parallel={"tp": 1, "pp": 1, "zero_stage": 1}))
        straight_file.write_text(json.dumps(read_metrics(straight_run / "run")))
    straight = json.loads(straight_file.read_text())
    hf, mc, data = tiny(work)
    run = fresh(work / "resume")
    cfg = recipe(run, mc, data, save_every=5, parallel={"tp": 1, "pp": 1, "zero_stage": 1})
    flag = run / "paused"
    proc = launch(1, cfg, env={"TOOLKIT_FAULT_PAUSE": f"checkpoint-before-marker@2:{flag}"}, wait=False)
    wait_for(flag.exists, proc)
    kill_tree(proc.pid)
    proc.wait()
    latest = (run / "run" / "checkpoints" / "latest").read_text()
    launch(1, cfg, "resume=auto")
    resumed = read_metrics(run / "run")
    same = [a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(resumed[5:], straight[5:])]
    return {"ok": latest == "step_0000005" and [m["step"] for m in resumed] == list(range(1, STEPS + 1)) and all(same),
            "latest_after_kill": latest, "steps_logged": [m["step"] for m in resumed],
            "bit_exact_steps": [m["step"] for m, s in zip(resumed[5:], same) if s],
            "resumed_losses": [m["loss"] for m in resumed[5:]], "straight_losses": [m["loss"] for m in straight[5:]]}


def stage_bench(work: Path, dry: bool) -> dict:
    """benchmarks/finetune_bench.py's comparison: bf16, ~1B parameters at sequence 2048 on a GPU;
    the tiny model at sequence 128 in a dry run."""
    sys.path.insert(0, str(Path(__file__).parent))
    from finetune_bench import SIZES, Shape, compare, prepare

    # a dry run times 1 step of each side on one process: it checks the plumbing, not the speed
    size, shape, steps, global_batch, processes = (("tiny", Shape(128, 4, "bf16"), 4, 8, 1) if dry else
                                                   ("1b", Shape(2048, 2, "bf16"), 13, 8, None))
    root = fresh(work / "bench")
    hf, mc, data = prepare(root, model=SIZES[size], seq=shape.seq, dtype="float32" if dry else "bfloat16")
    result = compare(root, hf, mc, data, steps, global_batch, shape, processes=processes)
    (root / BENCH_RESULT).write_text(json.dumps(result))  # the fp8 stage compares with its bf16 run
    return {"ok": True, "size": size, "device": device_name(), **result}


BENCH_RESULT = "bench.json"
FP8_AUC_TOLERANCE = 0.01  # Megatron-LM's FP8 CI: area under the loss curve within 1% of the reference's


def stage_fp8(work: Path, dry: bool) -> dict:
    """The bench's ours side again with precision=fp8 (tensorwise: TE's current scaling where TE runs,
    torchao's on the local spec): the same model, conversion, batches and steps as its bf16 run."""
    import math
    import statistics

    sys.path.insert(0, str(Path(__file__).parent))
    from finetune_bench import SAME_BUCKET, Shape, recipe_metrics

    root = work / "bench"
    if not (root / BENCH_RESULT).is_file():
        return {"ok": False, "why": "the bench stage's bf16 run is missing (it failed or was skipped)"}
    bf16 = json.loads((root / BENCH_RESULT).read_text())
    shape = bf16["shape"]
    steps, warmup = len(bf16["ours"]["losses"]), len(bf16["ours"]["losses"]) - shape["steps_timed"]
    logged = recipe_metrics(root, root / "mc", root / "data.jsonl", shape["processes"], steps, 1,
                            shape["global_batch"], (*SAME_BUCKET, "fp8.recipe=tensorwise"),
                            shape=Shape(shape["seq"], shape["micro"], "fp8"))
    timed = logged[warmup:]
    losses = [r["loss"] for r in logged]
    gap = abs(sum(losses) - sum(bf16["ours"]["losses"])) / sum(bf16["ours"]["losses"])
    fp8 = {"step_s": statistics.median(shape["global_batch"] * shape["seq"] / r["padded_tokens_per_s"] for r in timed),
           "mfu": statistics.median(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None,
           "peak_memory_bytes": max(r["peak_memory_bytes"] for r in timed), "losses": losses}
    return {"ok": all(math.isfinite(x) for x in losses) and gap < FP8_AUC_TOLERANCE, "device": device_name(),
            "recipe": "tensorwise", "fp8": fp8, "bf16": {k: bf16["ours"][k] for k in fp8}, "loss_area_gap": gap,
            "loss_area_tolerance": FP8_AUC_TOLERANCE, "step_time_ratio": fp8["step_s"] / bf16["ours"]["step_s"],
            "memory_ratio": fp8["peak_memory_bytes"] / bf16["ours"]["peak_memory_bytes"]}


STAGE_FUNCTIONS = {"install": stage_install, "env": stage_env, "smoke": stage_smoke, "gpu_tests": stage_gpu_tests,
                   "parity_fp32": stage_parity_fp32, "parity_bf16": stage_parity_bf16, "resume": stage_resume,
                   "bench": stage_bench, "fp8": stage_fp8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", nargs="?", type=Path, help="where summary.json and suite.log go")
    parser.add_argument("--dry", action="store_true", help="tiny sizes, every stage that can run on CPU")
    parser.add_argument("--wheelhouse", type=Path, help="install the project from this folder first (no index)")
    parser.add_argument("--budget-s", type=float, default=570, help="the whole suite's time limit (default 570)")
    parser.add_argument("--stage", choices=sorted(STAGE_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        sys.path.insert(0, str(REPO))
        extra = {"wheelhouse": str(args.wheelhouse)} if args.stage == "install" else {}
        result = STAGE_FUNCTIONS[args.stage](args.work, args.dry, **extra)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    if args.outdir is None:
        parser.error("OUTDIR is required: the folder for summary.json and suite.log")
    if args.wheelhouse is not None and not args.wheelhouse.is_dir():
        parser.error(f"--wheelhouse {args.wheelhouse}: no such folder (docs/install.md says how to build one)")
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as work:
        summary = run_suite(args.outdir, stage_table(Path(work), args.dry, args.wheelhouse), args.budget_s, args.dry)
    print(json.dumps({name: s["status"] for name, s in summary["stages"].items()}, indent=1))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
