"""Offline W&B runs read back with wandb's own record format, merged across restarts by run id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolkit.wandb_offline import TESTED_WANDB_VERSION, WandbReadError, iter_records, read_runs, read_segment

SECRET = "0123456789abcdef0123456789abcdef01234567"  # shaped like a W&B API key

WRITER = textwrap.dedent("""
    import os, signal, sys, time, wandb
    run_id, first, last, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    run = wandb.init(project="toolkit-test", id=run_id, resume="allow", dir=sys.argv[5], config={"lr": 0.1, "start": first})
    for step in range(first, last + 1):
        run.log({"loss": step + first / 100, "step": step}, step=step, commit=True)  # as the trainer does
    if how == "kill":
        time.sleep(3)  # wandb-core flushes the log every x_transaction_log_flush_interval (1 s here)
        os.kill(os.getpid(), signal.SIGKILL)
    run.finish()
""")


def write_segment(root: Path, run_id: str, first: int, last: int, how: str = "finish") -> None:
    # wandb 0.31 flushes the offline log every 15 s by default: a SIGKILL loses what came after the
    # last flush. A 1 s interval makes the killed start's rows reach the file in a short test.
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_API_KEY": SECRET,
           "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL": "1"}
    result = subprocess.run([sys.executable, "-c", WRITER, run_id, str(first), str(last), how, str(root)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == (-9 if how == "kill" else 0), result.stderr[-2000:]


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory) -> Path:
    """Run "job-1": a start killed after step 5 (checkpoint at 3), a restart from step 4 that finishes;
    plus an unrelated run in the same directory."""
    root = tmp_path_factory.mktemp("wandb")
    write_segment(root, "job-1", 1, 5, how="kill")
    write_segment(root, "job-1", 4, 8)
    write_segment(root, "other", 1, 2)
    return root


def test_restarts_merge_into_one_run_with_every_step_once_and_the_later_copy_winning(restarted_run):
    runs = read_runs(restarted_run)
    assert set(runs) == {"job-1", "other"}
    run = runs["job-1"]
    assert len(run.segments) == 2 and [s.exit_code for s in run.segments] == [None, 0]
    assert run.steps == list(range(1, 9))
    # steps 1-3 from the killed start, 4-8 from the restart (its values carry first=4)
    assert run.metric("loss") == [1.01, 2.01, 3.01, 4.04, 5.04, 6.04, 7.04, 8.04]
    assert run.config["lr"] == 0.1 and run.config["start"] == 4
    assert run.summary["loss"] == 8.04 and run.project == "toolkit-test"


def test_the_api_key_is_written_nowhere(restarted_run):
    for path in restarted_run.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_torn_tail_reads_as_the_records_before_it(restarted_run, tmp_path):
    source = next(p for p in restarted_run.rglob("run-*.wandb") if read_segment(p).exit_code == 0)
    data = source.read_bytes()
    torn = tmp_path / "run-torn.wandb"
    torn.write_bytes(data[: len(data) * 2 // 3])
    seg = read_segment(torn)
    full = read_segment(source)
    assert seg.history == full.history[: len(seg.history)] and seg.exit_code is None
    assert sum(1 for _ in iter_records(torn)) < sum(1 for _ in iter_records(source))


def test_not_a_wandb_file_is_refused(tmp_path):
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"PK\x03\x04 not a transaction log")
    with pytest.raises(WandbReadError, match="not a W&B transaction log"):
        read_segment(bad)
    with pytest.raises(WandbReadError, match="no offline W&B run"):
        read_runs(tmp_path / "empty") if (tmp_path / "empty").mkdir() is None else None


def test_wandb_summary_cli_reports_the_merged_run(restarted_run):
    import wandb

    assert wandb.__version__ == TESTED_WANDB_VERSION, "re-check the record format, then bump TESTED_WANDB_VERSION"
    result = subprocess.run([sys.executable, "-m", "toolkit", "wandb-summary", str(restarted_run), "--json"],
                            capture_output=True, text=True, check=True)
    summaries = {s["run_id"]: s for s in json.loads(result.stdout)}
    job = summaries["job-1"]
    assert job["steps"] == {"first": 1, "last": 8, "rows": 8, "each_once": True}
    assert [s["steps"] for s in job["segments"]] == [[1, 2, 3, 4, 5], [4, 5, 6, 7, 8]]
    text = subprocess.run([sys.executable, "-m", "toolkit", "wandb-summary", str(restarted_run)],
                          capture_output=True, text=True, check=True).stdout
    assert "run job-1 (project toolkit-test): 2 offline dir(s), steps 1..8 (8 rows, each once)" in text
    assert "killed (no exit record)" in text
