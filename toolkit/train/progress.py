"""What a person watching a run reads (rank 0): a line per start-up stage, then per logged step
`step N/TOTAL loss X ... | T tokens/s | ETA`, and a line per checkpoint saved (where, how long).

On a terminal a tqdm bar also moves every step; in a log file or under Slurm only the plain lines
are written (a bar's carriage returns would fill the log). MFU and TFLOP/s are shown only where a
device peak is known (a GPU, or peak_tflops given): on a CPU they would mean nothing. The figures
themselves are still in metrics.jsonl and W&B. `toolkit slurm status` reads the `step N` prefix.
"""

from __future__ import annotations

import os
import sys
import time

# Metrics shown after the loss, in this order, when present; the rest stay in metrics.jsonl.
SHOWN = ("eval_loss", "grad_norm", "lr", "loss_scale")


def interactive(stream) -> bool:
    return stream.isatty() and "SLURM_JOB_ID" not in os.environ


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    def __init__(self, active: bool, total_steps: int, show_mfu: bool = False, stream=None):
        self.active = active
        self.total, self.start_step, self.show_mfu = total_steps, 0, show_mfu
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self.first_step_at: float | None = None
        self.bar = None

    def begin(self, start_step: int) -> None:
        """The loop starts (after a resume, at `start_step`): the bar appears on a terminal."""
        self.start_step = start_step
        if self.active and interactive(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=start_step, unit="step", file=self.stream, dynamic_ncols=True)

    def _print(self, line: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def stage(self, text: str) -> None:
        """A start-up stage (the 20-95 s before step 1 are otherwise silent)."""
        self._print(f"start-up [{time.monotonic() - self.started:.0f} s]: {text}")

    def eta(self, step: int) -> str:
        """From the mean time of the steps after the first (which includes warm-up work)."""
        now = time.monotonic()
        if self.first_step_at is None:
            self.first_step_at = now
            return "?"
        done = step - self.start_step - 1
        if done <= 0:
            return "?"
        return duration((now - self.first_step_at) / done * (self.total - step))

    def line(self, step: int, metrics: dict) -> str:
        parts = [f"step {step}/{self.total} loss {metrics['loss']:.4f}"]
        parts += [f"{key} {metrics[key]:.4g}" for key in SHOWN if metrics.get(key) is not None]
        text = " ".join(parts) + f" | {metrics['tokens_per_s']:,.0f} tokens/s"
        if self.show_mfu and metrics.get("mfu") is not None:
            text += f" | {metrics['tflops_per_device']:.1f} TFLOP/s per device, MFU {metrics['mfu']:.1%}"
        return text

    def step(self, step: int, metrics: dict, logged: bool) -> None:
        """Every step: the bar moves; on logged steps a line with the ETA."""
        if not self.active:
            return
        eta = self.eta(step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {metrics['loss']:.4f}, {metrics['tokens_per_s']:,.0f} tokens/s", refresh=False)
        if logged:
            self._print(f"{self.line(step, metrics)} | ETA {eta}")

    def saved(self, step: int, path, seconds: float) -> None:
        self._print(f"saved checkpoint of step {step} to {path} in {seconds:.1f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
