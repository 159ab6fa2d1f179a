"""The run's progress as a person reads it: start-up stages, `step N/TOTAL loss ... | tokens/s |
ETA`, checkpoint lines; a bar only on a terminal; no MFU or TFLOP/s where no device peak is known."""

from __future__ import annotations

import io

from toolkit.slurm.status import _STEP_LINE
from toolkit.train.progress import Progress, duration

METRICS = {"loss": 2.345678, "grad_norm": 1.5, "lr": 3e-4, "tokens_per_s": 12345.6, "tflops_per_device": 0.02,
           "mfu": 0.02, "eval_loss": None}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_steps(progress: Progress, steps: range, logged=lambda s: True) -> None:
    progress.begin(steps.start - 1)
    for step in steps:
        progress.step(step, METRICS, logged(step))


def test_plain_lines_in_a_log_with_eta_and_no_mfu_on_cpu(monkeypatch):
    """Old code printed `step 1 loss 2.346 grad_norm 1.5 lr 0.0003 tokens_per_s 1.235e+04 ... mfu 0.02`
    (an MFU against a nominal CPU peak), no total, no ETA, nothing before step 1 or at a save."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = io.StringIO()
    progress = Progress(True, total_steps=10, show_mfu=False, stream=out)
    progress.stage("building the model")
    run_steps(progress, range(1, 4))
    progress.saved(3, "run/checkpoints/step_0000003", 1.25)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("start-up [") and lines[0].endswith("]: building the model")
    assert lines[1] == "step 1/10 loss 2.3457 grad_norm 1.5 lr 0.0003 | 12,346 tokens/s | ETA ?"
    assert lines[3].startswith("step 3/10 loss 2.3457") and " | ETA " in lines[3] and not lines[3].endswith("?")
    assert lines[4] == "saved checkpoint of step 3 to run/checkpoints/step_0000003 in 1.2 s"
    assert "MFU" not in out.getvalue() and "TFLOP" not in out.getvalue() and "\r" not in out.getvalue()
    assert _STEP_LINE.match(lines[3]).groups() == ("3", "2.3457")  # `toolkit slurm status` reads it


def test_mfu_shown_where_the_peak_is_known_and_a_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    terminal = Terminal()
    progress = Progress(True, total_steps=4, show_mfu=True, stream=terminal)
    run_steps(progress, range(1, 5), logged=lambda s: s == 4)
    progress.close()
    text = terminal.getvalue()
    assert "\r" in text and "4/4" in text  # tqdm's bar
    assert "| 0.0 TFLOP/s per device, MFU 2.0% | ETA" in text
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # under Slurm the log is a file, whatever isatty says
    under_slurm = Terminal()
    run_steps(Progress(True, 4, stream=under_slurm), range(1, 3))
    assert "\r" not in under_slurm.getvalue()
    quiet = io.StringIO()
    run_steps(Progress(False, 4, stream=quiet), range(1, 3))  # other ranks print nothing
    assert quiet.getvalue() == ""


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (4.4, 75, 3725)] == ["4s", "1m15s", "1h02m"]
