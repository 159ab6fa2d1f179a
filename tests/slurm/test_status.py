"""`toolkit slurm status`: sacct where the cluster has accounting, `scontrol show job` where it has not."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from toolkit.errors import SlurmError
from toolkit.slurm.status import parse_sacct, parse_scontrol, status

# Recorded from Slurm 22.05.8 (`scontrol show job -o`), with a work directory holding spaces.
SCONTROL_LINE = (
    "JobId=7 JobName=t1 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) "
    "QOS=(null) JobState={state} Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 "
    "ExitCode={exit} RunTime=00:00:58 TimeLimit=00:10:00 AllocNode:Sid=localhost:19969 NodeList=n[1-2] BatchHost=n1 "
    "NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=2 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4 "
    "Command={dir}/t1.sbatch WorkDir={dir} StdErr={dir}/t1-7.out StdIn=/dev/null StdOut={dir}/t1-7.out Power= "
)


def test_scontrol_fields_keep_values_with_spaces():
    fields = parse_scontrol(SCONTROL_LINE.format(state="RUNNING", exit="0:0", dir="/tmp/my runs"))
    assert fields["JobState"] == "RUNNING" and fields["Restarts"] == "1" and fields["NodeList"] == "n[1-2]"
    assert fields["StdOut"] == "/tmp/my runs/t1-7.out" and fields["AllocNode:Sid"] == "localhost:19969"
    assert fields["TRES"] == "cpu=4,node=2,billing=4" and fields["Power"] == ""


def test_sacct_takes_the_newest_record_of_a_requeued_job():
    assert parse_sacct("REQUEUED|0:0\nCOMPLETED|0:0\n") == ("COMPLETED", "0:0")
    assert parse_sacct("") is None


def _fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def test_without_accounting_status_falls_back_to_scontrol_and_reads_the_log(fake_slurm, tmp_path):
    log = tmp_path / "my runs" / "t1-7.out"
    log.parent.mkdir()
    log.write_text("toolkit: job 7 start 0\nstep 1 loss 5.5 grad_norm 1\nwarning\nstep 2 loss 5.25 grad_norm 1\n")
    _fake(fake_slurm, "sacct", "echo 'Slurm accounting storage is disabled' >&2; exit 1\n")
    _fake(fake_slurm, "scontrol", f"cat <<'EOF'\n{SCONTROL_LINE.format(state='RUNNING', exit='0:0', dir=log.parent)}\nEOF\n")
    s = status("7")
    assert (s.source, s.state, s.restarts, s.last_step, s.last_loss) == ("scontrol", "RUNNING", 1, 2, 5.25)
    assert s.line() == "job 7: RUNNING, exit 0:0, restarts 1, last step 2 loss 5.2500  [scontrol]"


def test_with_accounting_status_uses_sacct_and_the_run_dir(fake_slurm, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 4)))
    _fake(fake_slurm, "sacct", "printf 'REQUEUED|0:0\\nFAILED|1:0\\n'\n")
    _fake(fake_slurm, "scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\n")
    s = status("7", run_dir)
    assert (s.source, s.state, s.exit_code, s.last_step, s.last_loss) == ("sacct", "FAILED", "1:0", 4, 0.25)


def test_a_job_nobody_knows_is_a_clear_error(fake_slurm):
    _fake(fake_slurm, "sacct", "echo 'Slurm accounting storage is disabled' >&2; exit 1\n")
    _fake(fake_slurm, "scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\n")
    with pytest.raises(SlurmError, match="unknown to scontrol, and the cluster has no accounting"):
        status("7")
    with pytest.raises(SlurmError, match="not a number"):
        status("7; rm -rf /")
