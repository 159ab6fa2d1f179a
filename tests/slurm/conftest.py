"""A real Slurm cluster (munge, slurmctld, two slurmd "nodes" n1 and n2 on this host), started by
slurm/ci/slurm-up.sh for the tests that ask for it and stopped at the end of the session."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "slurm" / "ci"
CLUSTER_DIR = os.environ.get("SLURM_CI_DIR", "/var/tmp/toolkit-slurm-ci")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED"}


@dataclass(frozen=True)
class Cluster:
    conf: str
    started_by_us: bool
    startup_s: float


def _cluster_running() -> bool:
    pid_file = Path(CLUSTER_DIR) / "run" / "slurmctld.pid"
    return pid_file.is_file() and Path(f"/proc/{pid_file.read_text().strip()}").exists()


@pytest.fixture(scope="session")
def slurm_cluster() -> Cluster:
    if os.geteuid() != 0 or not (shutil.which("apt-get") or shutil.which("slurmctld")):
        reason = "starting a local Slurm cluster needs root and Debian's apt-get (or Slurm installed)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI provides both, so this is a broken set-up, not a skip")
        pytest.skip(reason)
    already = _cluster_running()
    began = time.monotonic()
    result = subprocess.run(["bash", str(CI / "slurm-up.sh")], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "SLURM_CI_DIR": CLUSTER_DIR})
    assert result.returncode == 0, f"slurm-up.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    cluster = Cluster(f"{CLUSTER_DIR}/etc/slurm.conf", not already, time.monotonic() - began)
    print(f"\nslurm cluster ready in {cluster.startup_s:.1f} s (started by these tests: {cluster.started_by_us})")
    yield cluster
    if cluster.started_by_us:
        subprocess.run(["bash", str(CI / "slurm-down.sh")], capture_output=True, timeout=300,
                       env={**os.environ, "SLURM_CI_DIR": CLUSTER_DIR})


def job_field(job_id: str, name: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
    m = re.search(rf"(?:^|\s){name}=(\S*)", out)
    return m.group(1) if m else None


def wait_for_state(job_id: str, states=FINAL_STATES, timeout: float = 600) -> str:
    """Poll scontrol every 0.5 s (sbatch --wait sleeps up to 32 s between its own polls)."""
    deadline = time.monotonic() + timeout
    while True:
        state = job_field(job_id, "JobState")
        if state in states:
            return state
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.5)


def wait_until(predicate, timeout: float, what: str, job_id: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job_id is not None:
            state = job_field(job_id, "JobState")
            assert state not in FINAL_STATES, f"job {job_id} ended ({state}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def toolkit(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI, as a user runs it (the interpreter running these tests has the toolkit installed)."""
    import sys

    result = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def submitted_job_id(stdout: str) -> str:
    m = re.search(r"submitted job (\d+)", stdout)
    assert m, stdout
    return m.group(1)
