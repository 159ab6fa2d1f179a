"""`toolkit slurm status JOBID`: the job's state and the last step it logged.

State comes from `sacct` where the cluster keeps accounting (slurmdbd). Without it sacct answers
"Slurm accounting storage is disabled", and `scontrol show job` is used instead; the controller
forgets a finished job after MinJobAge (300 s by default).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import SlurmError

_STEP_LINE = re.compile(r"^step (\d+)(?:/\d+)? loss (\S+)")  # the trainer's line on rank 0 (toolkit.train.progress)
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str
    exit_code: str | None = None
    restarts: int | None = None
    reason: str | None = None
    stdout: str | None = None
    source: str = "scontrol"  # or "sacct"
    last_step: int | None = None
    last_loss: float | None = None

    def line(self) -> str:
        parts = [f"job {self.job_id}: {self.state}"]
        if self.exit_code:
            parts.append(f"exit {self.exit_code}")
        if self.restarts:
            parts.append(f"restarts {self.restarts}")
        if self.reason and self.reason != "None":
            parts.append(f"reason {self.reason}")
        if self.last_step is not None:
            parts.append(f"last step {self.last_step}" + (f" loss {self.last_loss:.4f}" if self.last_loss is not None else ""))
        else:
            parts.append("no step logged yet")
        return ", ".join(parts) + f"  [{self.source}]"


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {field: value}; values may contain spaces (Command, paths)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    found = list(_FIELD.finditer(line))
    out = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def parse_sacct(text: str) -> tuple[str, str] | None:
    """`sacct -n -P -X --format=State,ExitCode` -> (state, exit code) of the job's newest record."""
    rows = [line.split("|") for line in text.strip().splitlines() if line.strip()]
    if not rows or len(rows[-1]) < 2:
        return None
    return rows[-1][0], rows[-1][1]


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None


def last_logged_step(run_dir: str | Path | None = None, stdout: str | Path | None = None) -> tuple[int, float | None] | None:
    """From RUN_DIR/metrics.jsonl when given, else from the trainer's `step N loss X` lines in the job log."""
    if run_dir is not None:
        path = Path(run_dir) / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        for line in reversed(lines):
            if line.strip():
                record = json.loads(line)
                return int(record["step"]), record.get("loss")
        return None
    if stdout and Path(stdout).is_file():
        for line in reversed(Path(stdout).read_text(errors="replace").splitlines()):
            m = _STEP_LINE.match(line)
            if m:
                return int(m.group(1)), float(m.group(2))
    return None


def status(job_id: str, run_dir: str | Path | None = None) -> JobStatus:
    if not str(job_id).isdigit():
        raise SlurmError(f"job id {job_id!r} is not a number")
    job_id = str(job_id)
    fields: dict[str, str] = {}
    shown = _run(["scontrol", "show", "job", "-o", job_id])
    if shown is not None and shown.returncode == 0:
        fields = parse_scontrol(shown.stdout)
    state = exit_code = None
    source = "scontrol"
    acct = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "--format=State,ExitCode"])
    if acct is not None and acct.returncode == 0 and "accounting storage is disabled" not in acct.stderr.lower():
        parsed = parse_sacct(acct.stdout)
        if parsed:
            (state, exit_code), source = parsed, "sacct"
    if state is None:
        if not fields:
            if shown is None:
                raise SlurmError("neither sacct nor scontrol is available: run this on a Slurm login node")
            raise SlurmError(f"job {job_id} is unknown to scontrol, and the cluster has no accounting "
                             "(the controller forgets finished jobs after MinJobAge)")
        state, exit_code = fields.get("JobState", "UNKNOWN"), fields.get("ExitCode")
    restarts = fields.get("Restarts")
    stdout = fields.get("StdOut")
    last = last_logged_step(run_dir, stdout)
    return JobStatus(job_id, state.split()[0], exit_code, int(restarts) if restarts and restarts.isdigit() else None,
                     fields.get("Reason"), stdout, source, *(last or (None, None)))
