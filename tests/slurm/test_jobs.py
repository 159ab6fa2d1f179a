"""Jobs on a real Slurm cluster (slurmctld + two slurmd "nodes" on this host, see conftest.py):
the tiny recipe at TP2 x PP2 across both nodes, preemption and requeue, rank death, and the
launch chain itself with hostile values."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.finetune_harness import launch, read_metrics, recipe, write_uneven_data
from tests.slurm.conftest import job_field, submitted_job_id, toolkit, wait_for_state, wait_until
from toolkit.train.checkpoint import find_latest
from toolkit.wandb_offline import read_runs

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

STEPS = 12
SECRET = "0123456789abcdef0123456789abcdef01234567"  # shaped like a W&B API key
# SIGKILL of one rank -> job FAILED within: torchrun's monitor interval (1 s) + the rest of that
# node's ranks failing on the broken gloo connection (bounded by --shutdown-timeout, 60 s here) +
# srun --kill-on-bad-exit + KillWait (5 s on this cluster). Measured: see the test's output.
RANK_DEATH_BOUND_S = 75
METRICS = {"loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("slurm-tiny")
    hf = make_tiny_model("llama", root / "hf", dtype="float32", num_hidden_layers=4)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    return mc, write_uneven_data(root / "train.jsonl", 300), write_uneven_data(root / "valid.jsonl", 32, seed=1)


def tp2pp2(workdir: Path, tiny, **overrides) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    mc, train, valid = tiny
    return recipe(workdir, mc, train, parallel={"tp": 2, "pp": 2, "zero_stage": 1}, steps=STEPS, eval_every=6,
                  data__valid_file=str(valid), **overrides)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> list[dict]:
    """The same recipe run directly with torchrun on one machine, uninterrupted."""
    workdir = tmp_path_factory.mktemp("reference")
    launch(4, tp2pp2(workdir, tiny))
    return read_metrics(workdir / "run")


def submit(cfg: Path, workdir: Path, name: str, *args: str, env: dict | None = None) -> str:
    result = toolkit("slurm", "submit", str(cfg), "--cpu", "--nodes", "2", "--procs-per-node", "2",
                     "--cpus-per-task", "2", "--time", "15", "--signal-lead", "300", "--shutdown-timeout", "60",
                     "--job-name", name, "--output", f"{workdir}/%x-%j.out", "-o", f"{workdir}/{name}.sbatch",
                     "--wandb-project", "toolkit-ci", "--wandb-mode", "offline", *args,
                     env={"PYTHONWARNINGS": "ignore", **(env or {})})
    assert "watch: squeue -j" in result.stdout
    return submitted_job_id(result.stdout)


def log_of(workdir: Path, name: str, job_id: str) -> str:
    path = workdir / f"{name}-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def assert_completed(job_id: str, workdir: Path, name: str) -> None:
    state = wait_for_state(job_id, timeout=900)
    assert state == "COMPLETED", f"job {job_id} {state}:\n{log_of(workdir, name, job_id)[-6000:]}"


def assert_same_losses(run_dir: Path, reference: list[dict]) -> list[dict]:
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step logged exactly once"
    assert [m["loss"] for m in metrics] == [m["loss"] for m in reference]
    assert [m.get("eval_loss") for m in metrics] == [m.get("eval_loss") for m in reference]
    return metrics


def assert_one_wandb_run(run_dir: Path, run_id: str, metrics: list[dict]):
    runs = read_runs(run_dir / "wandb")
    assert set(runs) == {run_id}, f"one W&B run for the whole job, got {sorted(runs)}"
    run = runs[run_id]
    assert run.steps == list(range(1, STEPS + 1)), f"every step exactly once: {[s.path.parent.name for s in run.segments]}"
    assert run.metric("loss") == [m["loss"] for m in metrics]
    return run


def no_secret_in(*paths: Path) -> None:
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert SECRET.encode() not in path.read_bytes(), f"API key written to {path}"


def test_two_node_job_matches_torchrun_and_usr1_checkpoints_requeues_and_resumes_into_one_wandb_run(
        slurm_cluster, tiny, reference, tmp_path):
    """A TP2 x PP2 job on two nodes gives the losses of torchrun on one machine (every step, the evals too),
    with a USR1 to the batch shell on the way: it checkpoints, requeues and resumes into one W&B run.
    (One job for both: an uninterrupted job would repeat the same losses, W&B config and status checks.)"""
    cfg = tp2pp2(tmp_path, tiny)
    run_dir = tmp_path / "run"
    job_id = submit(cfg, tmp_path, "preempt", "--max-restarts", "1", env={"WANDB_API_KEY": SECRET})
    wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3, 600,
               "step 3", job_id)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    signalled = time.monotonic()
    wait_until(lambda: job_field(job_id, "Restarts") == "1", 300, "the requeue")
    requeued_after = time.monotonic() - signalled
    assert_completed(job_id, tmp_path, "preempt")

    assert job_field(job_id, "NodeList") == "n[1-2]" and job_field(job_id, "NumNodes") == "2"
    log = log_of(tmp_path, "preempt", job_id)
    assert f"toolkit: job {job_id} start 0 on n[1-2] (2 x 2), rendezvous n1:" in log
    saved = int(re.search(r"SIGUSR1 received: saved step (\d+), exiting for requeue", log).group(1))
    assert 3 <= saved < STEPS
    assert "toolkit: stopped on SIGUSR1 after a checkpoint; requeueing (restart 1 of 1)" in log
    assert f"toolkit: job {job_id} start 1 on n[1-2]" in log and f"resuming at step {saved}" in log
    assert "toolkit: training finished" in log
    metrics = assert_same_losses(run_dir, reference)
    assert find_latest(run_dir).name == f"step_{STEPS:07d}"

    run = assert_one_wandb_run(run_dir, f"slurm-{job_id}", metrics)
    assert METRICS <= set(run.history[0]) and [r["_step"] for r in run.history if "eval_loss" in r] == [6, 12]
    assert {"config", "layout", "deepspeed", "data"} <= set(run.config)
    assert run.config["layout"]["world_size"] == 4 and run.config["layout"]["tp"] == 2
    assert "wandb" not in run.config["deepspeed"] or not run.config["deepspeed"]["wandb"].get("enabled")
    status = toolkit("slurm", "status", job_id).stdout
    assert status.startswith(f"job {job_id}: COMPLETED, exit 0:0") and f"last step {STEPS} " in status
    assert [[r["_step"] for r in s.history] for s in run.segments] == \
        [list(range(1, saved + 1)), list(range(saved + 1, STEPS + 1))]
    assert [s.exit_code for s in run.segments] == [0, 0]
    no_secret_in(tmp_path / "preempt.sbatch", tmp_path / f"preempt-{job_id}.out", run_dir)
    print(f"\nUSR1 -> checkpoint at step {saved} -> requeued {requeued_after:.1f} s after the signal")


def _rank_pid(job_id: str, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(errors="replace")
                       .split("\0") if "=" in item)
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (env.get("SLURM_JOB_ID") == job_id and env.get("RANK") == str(rank) and b"finetune.py" in cmdline
                and b"torch.distributed.run" not in cmdline):
            return int(proc.name)
    return None


def test_sigkill_of_one_rank_fails_the_job_in_bounded_time_and_the_checkpoint_resumes(slurm_cluster, tiny,
                                                                                       reference, tmp_path):
    cfg = tp2pp2(tmp_path, tiny, save_every=3)
    run_dir = tmp_path / "run"
    first = submit(cfg, tmp_path, "killed", env={"WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "1"})
    wait_until(lambda: (run_dir / "checkpoints" / "latest").exists(), 600, "the first checkpoint", first)
    pid = _rank_pid(first, 3)
    assert pid, "rank 3 (on n2) not found"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    state = wait_for_state(first, timeout=300)
    took = time.monotonic() - killed
    assert state == "FAILED", log_of(tmp_path, "killed", first)[-4000:]
    assert took < RANK_DEATH_BOUND_S, f"job took {took:.1f} s to fail after a rank died"
    assert _rank_pid(first, 0) is None and _rank_pid(first, 1) is None, "no rank outlives the job"
    checkpoint = find_latest(run_dir)  # complete (train_state.json present), never a torn one
    killed_at = len(read_metrics(run_dir))

    # Resubmitting the same job resumes from that checkpoint; the same W&B run id continues the run.
    second = submit(cfg, tmp_path, "killed", env={"TOOLKIT_WANDB_RUN_ID": f"slurm-{first}",
                                                   "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "1"})
    assert_completed(second, tmp_path, "killed")
    step = int(checkpoint.name.removeprefix("step_"))
    assert f"resuming at step {step}" in log_of(tmp_path, "killed", second)
    metrics = assert_same_losses(run_dir, reference)
    run = assert_one_wandb_run(run_dir, f"slurm-{first}", metrics)
    assert run.segments[-1].history[0]["_step"] == step + 1
    print(f"\nrank 3 SIGKILLed after step {killed_at} -> job FAILED in {took:.1f} s (bound {RANK_DEATH_BOUND_S} s); "
          f"resumed from {checkpoint.name}")


def test_hostile_values_reach_every_rank_verbatim_on_both_nodes_and_the_restart_cap_holds(slurm_cluster, tmp_path):
    """The launch chain with the probe: every value that is not refused is hostile, the ranks of each
    node get them verbatim, nothing planted runs; USR1 twice with max_restarts=1 -> one requeue, then FAILED."""
    canary = tmp_path / "CANARY"
    c = shlex.quote(str(canary))
    evil = [f"$(touch {c})", f"`touch {c}`", f"'; touch {c}; '", f'"; touch {c}; "', f"a b; touch {c} #",
            f"${{IFS}}touch${{IFS}}{c}", "*", "~root"]
    weird = tmp_path / "d $(touch CANARY) `x` 'q'"
    weird.mkdir()
    python = weird / "py $(touch CANARY);'"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    probe = weird / "probe `touch CANARY`.py"
    probe.write_text((Path(__file__).parent / "probe.py").read_text())
    config = weird / "recipe $(touch CANARY).yaml"
    config.write_text(yaml.safe_dump({"model": {"checkpoint": "x"}, "data": {"train_file": "y"},
                                      "parallel": {"tp": 2, "pp": 2}, "micro_batch": 2, "global_batch": 16}))
    out = tmp_path / "probe-out"
    out.mkdir()
    overrides = [f"model.checkpoint=x{s}" for s in evil]
    env_args = [f"--env=PROBE_{i}={s}" for i, s in enumerate(evil)]
    result = toolkit("slurm", "submit", str(config), *overrides, "--cpu", "--nodes", "2", "--procs-per-node", "2",
                     "--cpus-per-task", "2", "--time", "5", "--signal-lead", "120", "--shutdown-timeout", "30",
                     "--max-restarts", "1", "--job-name", "probe", "--output", f"{tmp_path}/%x-%j.out",
                     "--python", str(python), "--script", str(probe), "-o", str(tmp_path / "probe.sbatch"), *env_args,
                     env={"PROBE_OUT": str(out), "PROBE_ALLREDUCE": "1", "PROBE_WAIT_USR1": "120",
                          "HF_HOME": str(tmp_path / "hf home"), "WANDB_API_KEY": SECRET})
    job_id = submitted_job_id(result.stdout)
    for restart in (0, 1):
        wait_until(lambda: len(list(out.glob(f"ready-restart{restart}-rank*"))) == 4, 300, f"start {restart}", job_id)
        records = [json.loads((out / f"restart{restart}-rank{r}.json").read_text()) for r in range(4)]
        assert [(r["rank"], r["local_rank"], r["node"], r["world_size"]) for r in records] == \
            [(0, 0, "n1", 4), (1, 1, "n1", 4), (2, 0, "n2", 4), (3, 1, "n2", 4)]
        for r in records:
            assert r["allreduce"] == 10.0 and r["env"]["MASTER_ADDR"] == "n1"
            assert r["argv"] == ["--config", str(config), *overrides, "resume=auto"]
            assert all(r["env"][f"PROBE_{i}"] == s for i, s in enumerate(evil))
            assert r["env"]["HF_HOME"] == str(tmp_path / "hf home") and r["env"]["WANDB_API_KEY"] == SECRET
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    assert wait_for_state(job_id, timeout=120) == "FAILED"
    assert job_field(job_id, "Restarts") == "1"
    log = log_of(tmp_path, "probe", job_id)
    assert "requeueing (restart 1 of 1)" in log and "the restart cap (1) is reached; resubmit to resume" in log
    assert not list(tmp_path.rglob("CANARY")), "a planted command ran"
    no_secret_in(tmp_path / "probe.sbatch", tmp_path / f"probe-{job_id}.out")


def _idle_nodes() -> set[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
    return {name for name, state in (line.split() for line in out.splitlines()) if state == "idle"}


def test_requeued_job_comes_back_on_one_node_and_resumes_at_that_layout_into_one_wandb_run(slurm_cluster, tiny,
                                                                                            tmp_path):
    """--min-nodes 1 --max-nodes 2 at TP2: the job starts on n1 + n2 (DP2), n2 is drained and the job
    preempted with `scontrol requeue`; it comes back on n1 alone (DP1), resumes the last checkpoint
    through the layout-independent state with the global batch kept, and finishes: one W&B run."""
    mc, train, valid = tiny
    cfg = recipe(tmp_path, mc, train, parallel={"tp": 2, "pp": 1, "zero_stage": 1}, steps=STEPS, save_every=3)
    run_dir = tmp_path / "run"
    wait_until(lambda: _idle_nodes() == {"n1", "n2"}, 60, "both nodes idle")  # else Slurm may start it on one
    job_id = submit(cfg, tmp_path, "shrink", "--min-nodes", "1", env={"WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "1"})
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "latest").exists(), 600, "the first checkpoint", job_id)
        assert job_field(job_id, "NumNodes") == "2"
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=toolkit-test"], check=True)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        assert_completed(job_id, tmp_path, "shrink")
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=False)
    log = log_of(tmp_path, "shrink", job_id)
    assert f"toolkit: job {job_id} start 0 on n[1-2] (2 x 2)" in log
    assert f"toolkit: job {job_id} start 1 on n1 (1 x 2)" in log
    resumed = int(re.findall(r"resuming at step (\d+)", log)[-1])  # the SIGTERM save, or the last periodic one
    assert 3 <= resumed < STEPS
    layouts = [ast.literal_eval(found) for found in re.findall(r"resolved layout (\{.*?\});", log)]
    assert layouts[0]["dp"] == 2 and layouts[0]["world_size"] == 4, layouts
    last = {k: layouts[-1][k] for k in ("tp", "pp", "dp", "zero_stage", "world_size", "num_microbatches")}
    assert last == {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 1, "world_size": 2, "num_microbatches": 8}, layouts
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step logged exactly once"

    run = assert_one_wandb_run(run_dir, f"slurm-{job_id}", metrics)
    assert run.segments[-1].history[0]["_step"] == resumed + 1
    assert run.segments[-1].config["layout"]["world_size"] == 2
    print(f"\n2 nodes (DP2) -> scontrol requeue -> 1 node (DP1), resumed at step {resumed}")
