"""GPU paths of the rendered script: NCCL on every GPU of a node, Transformer Engine fine-tuning,
and a GPU job on a Slurm cluster with GRES. This project's CI machine has no GPU, no NCCL and no
Transformer Engine, so these are skipped there with the reason; the GPU rendering's other cover is
the drift test on slurm/finetune-gpu.sbatch and a review of its srun/torchrun line."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.finetune_harness import (GRAD_NORM_TOLERANCE_BF16, LOSS_TOLERANCE_BF16, differences, hf_reference, read_metrics,
                                    recipe, write_uneven_data)
from tests.slurm.conftest import submitted_job_id, toolkit, wait_for_state
from toolkit.slurm import Launch, Preemption, Resources, SlurmJob, render
from toolkit.slurm.render import write

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HAS_NCCL = GPUS > 0 and torch.distributed.is_nccl_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
PROBE = Path(__file__).with_name("probe.py")



def _gres_gpu_cluster() -> bool:
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True).stdout
    return "gpu" in out


def run_on_this_node(script: Path, tmp: Path, env: dict) -> subprocess.CompletedProcess:
    """Run a rendered script as a one-node job: stand-ins for scontrol and srun (srun runs the task as node 0)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", "[ \"$1 $2\" = 'show hostnames' ] && echo localhost\n"),
                       ("srun", 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n')):
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1", "SLURM_NNODES": "1",
                "SLURM_JOB_NODELIST": "localhost", **env}
    return subprocess.run(["bash", str(script)], env=full_env, cwd=tmp, capture_output=True, text=True, timeout=1800)


def gpu_job(config: Path, script: str, gpus: int, overrides=()) -> SlurmJob:
    return SlurmJob(config=str(config), overrides=tuple(overrides),
                    resources=Resources(nodes=1, gpus_per_node=gpus, cpus_per_task=4 * gpus, time="30"),
                    launch=Launch(python=sys.executable, script=script),
                    preemption=Preemption(signal_lead=120, shutdown_timeout=90))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2 or not HAS_NCCL, reason=f"needs 2 CUDA GPUs with NCCL (this machine: {GPUS} GPUs)")
def test_rendered_gpu_script_joins_nccl_on_every_gpu_of_the_node(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": "x"}, "data": {"train_file": "y"},
                                      "micro_batch": 1, "global_batch": GPUS}))
    out = tmp_path / "out"
    out.mkdir()
    script = write(gpu_job(config, str(PROBE), GPUS), tmp_path / "job.sbatch")
    result = run_on_this_node(script, tmp_path, {"PROBE_OUT": str(out), "PROBE_ALLREDUCE": "1", "PROBE_BACKEND": "nccl"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads((out / f"restart0-rank{r}.json").read_text()) for r in range(GPUS)]
    assert all(r["allreduce"] == GPUS * (GPUS + 1) / 2 for r in records)
    assert all(r["env"]["NCCL_DEBUG"] == "WARN" and r["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" for r in records)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(GPUS < 2 or not HAS_TE, reason=f"needs Transformer Engine and 2 CUDA GPUs (this machine: {GPUS} "
                                                    f"GPUs, transformer_engine {'present' if HAS_TE else 'absent'})")
def test_rendered_gpu_script_fine_tunes_tp2_bf16_with_transformer_engine(tmp_path):
    from toolkit.convert import hf_to_megatron
    from toolkit.model import running_layer_spec
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", dtype="bfloat16", num_hidden_layers=4)
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    data = write_uneven_data(tmp_path / "train.jsonl", 200)
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 2, "pp": 1}, precision="bf16", steps=6)
    script = write(gpu_job(cfg, str(Path(__file__).parents[2] / "recipes" / "finetune.py"), 2), tmp_path / "job.sbatch")
    result = run_on_this_node(script, tmp_path, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # against the fp32 HF reference on the GPU, at the bf16 bars of the CPU tests (losses and gradient norms)
    loss, norm = differences(read_metrics(tmp_path / "run"), *hf_reference(hf, data, cfg, 6, device="cuda"))
    print(f"TP2 bf16 (layer spec {running_layer_spec()}): max |loss - HF reference| {loss:.1e}, grad norm relative "
          f"{norm:.1e}")
    assert loss < LOSS_TOLERANCE_BF16 and norm < GRAD_NORM_TOLERANCE_BF16, (loss, norm)


@pytest.mark.gpu
@pytest.mark.slurm
@pytest.mark.skipif(not _gres_gpu_cluster(), reason="needs a Slurm cluster with GPU GRES (the local CI cluster has none)")
def test_gpu_job_on_a_gres_cluster_completes(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": "x"}, "data": {"train_file": "y"},
                                      "micro_batch": 1, "global_batch": 2}))
    out = tmp_path / "out"
    out.mkdir()
    result = toolkit("slurm", "submit", str(config), "--nodes", "1", "--gpus-per-node", "2", "--time", "10",
                     "--signal-lead", "120", "--shutdown-timeout", "60", "--script", str(PROBE),
                     "--output", f"{tmp_path}/%x-%j.out", "-o", str(tmp_path / "gpu.sbatch"),
                     env={"PROBE_OUT": str(out), "PROBE_ALLREDUCE": "1", "PROBE_BACKEND": "nccl"})
    job_id = submitted_job_id(result.stdout)
    assert wait_for_state(job_id, timeout=1800) == "COMPLETED"
    assert [json.loads((out / f"restart0-rank{r}.json").read_text())["allreduce"] for r in range(2)] == [3.0, 3.0]


def test_gpu_rendering_is_what_the_gpu_tests_run(tmp_path):
    """Runs everywhere: the rendering the skipped tests would run asks for GPUs and one rank per GPU."""
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": "x"}, "data": {"train_file": "y"},
                                      "micro_batch": 1, "global_batch": 8}))
    text = render(gpu_job(config, str(PROBE), 8))
    assert "#SBATCH --gpus-per-node=8" in text and "NPROC_PER_NODE=8" in text
    assert 'export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"' in text
