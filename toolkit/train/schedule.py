"""The learning-rate schedule: linear warmup to optim.lr, then cosine decay to optim.min_lr (or
constant), as a factor of optim.lr per optimizer step for torch's LambdaLR.

Extending a run. Resuming with a larger `steps` continues the cosine from where it stands: the
LR at the resume step is kept, and from there it decays to min_lr at the new last step, so the LR
never jumps back up. A constant schedule simply continues. Changing lr, min_lr, warmup_steps or
the schedule kind on resume is refused: the optimizer state was built for the old values. So is
extending a cosine that already decayed to min_lr=0: every extra step would train at LR 0, and a new
run from the checkpoint's weights (with a schedule of its own) is what the user meant.

The schedule is a callable object with plain-number attributes, so LambdaLR's state_dict (which
DeepSpeed saves in every checkpoint) carries it, and a resumed run knows the schedule it was on,
including earlier extensions.
"""

from __future__ import annotations

import math
import os

from toolkit.errors import ConfigError

# The fields a resumed run must keep; `total_steps` may grow.
FIXED_ON_RESUME = ("lr", "min_lr", "warmup_steps", "kind")


class LRSchedule:
    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int, kind: str):
        self.lr, self.min_lr, self.kind = lr, min_lr, kind
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        # The cosine segment runs from (anchor_step, anchor_factor) down to min_lr at total_steps.
        self.anchor_step = warmup_steps
        self.anchor_factor = 1.0

    @classmethod
    def from_config(cls, cfg) -> LRSchedule:
        o = cfg.optim
        return cls(o.lr, o.min_lr, o.warmup_steps, cfg.steps, o.schedule)

    def state(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict) -> LRSchedule:
        schedule = cls.__new__(cls)
        vars(schedule).update(state)
        return schedule

    def __call__(self, step: int) -> float:
        """Factor of `lr` for the optimizer step that follows `step` completed steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        floor = self.min_lr / self.lr
        progress = min(1.0, (step - self.anchor_step) / max(1, self.total_steps - self.anchor_step))
        return floor + (self.anchor_factor - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def continue_as(self, requested: LRSchedule, at_step: int, checkpoint: str | os.PathLike = "CHECKPOINT") -> None:
        """After a checkpoint of step `at_step` restored this schedule: go on as `requested` asks.
        `checkpoint` (its directory) only names the way out of a refusal."""
        changed = [f"{name} {getattr(self, name)} -> {getattr(requested, name)}"
                   for name in FIXED_ON_RESUME if getattr(self, name) != getattr(requested, name)]
        if changed:
            raise ConfigError(
                f"the LR schedule changed since the checkpoint at step {at_step} ({', '.join(changed)}): resume "
                "with the values it was written with (only `steps` may grow), or start a new run_dir"
            )
        if requested.total_steps < at_step:
            raise ConfigError(f"steps={requested.total_steps} is below the checkpoint's step {at_step}: "
                              "a resumed run can only be extended")
        if requested.total_steps > max(at_step, self.total_steps) and self(at_step) <= 0.0:
            raise ConfigError(
                f"steps={requested.total_steps} extends a run whose cosine schedule already decayed to optim.min_lr=0 at "
                f"step {self.total_steps}: its {requested.total_steps - at_step} extra steps would train at LR 0. Start a "
                f"new run_dir from its weights instead (model.checkpoint={checkpoint}/model, or with LoRA "
                f"peft.init_from={checkpoint}/adapter, and a schedule of its own), and give a run you mean to extend "
                "optim.min_lr>0"
            )
        if requested.total_steps != self.total_steps:
            if at_step > self.anchor_step:
                self.anchor_step, self.anchor_factor = at_step, self(at_step)
            self.total_steps = requested.total_steps
