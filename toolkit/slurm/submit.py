"""Render a job, then hand it to `sbatch`."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import SlurmError
from toolkit.slurm.render import SlurmJob, anchored, write


@dataclass(frozen=True)
class Submission:
    job_id: str | None  # None for a dry run
    script: Path
    output: str  # the job's log, with %j and %x filled in where known
    command: tuple[str, ...]

    def lines(self) -> list[str]:
        if self.job_id is None:
            return [f"wrote {self.script}", "dry run, not submitted: " + " ".join(self.command), f"output: {self.output}"]
        return [f"submitted job {self.job_id} ({self.script})", f"output: {self.output}",
                f"watch: squeue -j {self.job_id}   (or: toolkit slurm status {self.job_id})"]


def output_path(pattern: str, job_name: str, job_id: str | None) -> str:
    """sbatch's filename pattern with the parts known at submission filled in."""
    out = pattern.replace("%%", "\0").replace("%x", job_name)
    if job_id is not None:
        out = out.replace("%j", job_id).replace("%A", job_id)
    return out.replace("\0", "%")


def submit(job: SlurmJob, script: str | Path, dry_run: bool = False, sbatch: str = "sbatch") -> Submission:
    """Render `job` to `script` (everything is validated first), then `sbatch --parsable` it."""
    path = write(job, script)
    job = anchored(job)  # the log path as the script holds it: absolute, under the job's working directory
    # sbatch does not create the log's directory, and a job whose log can't be opened fails silently.
    log_dir = Path(output_path(job.output, job.job_name, "0")).parent
    command = (sbatch, "--parsable", str(path))
    if dry_run:
        return Submission(None, path, output_path(job.output, job.job_name, None), command)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SlurmError(f"{sbatch} not found: run this on a Slurm login node (or use --dry-run)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{sbatch} did not answer within 120 s") from None
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SlurmError(f"sbatch refused {path}: {message}")
    job_id = result.stdout.strip().split(";")[0]  # --parsable prints "ID" or "ID;cluster"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed {result.stdout.strip()!r}, not a job id")
    return Submission(job_id, path, output_path(job.output, job.job_name, job_id), command)
