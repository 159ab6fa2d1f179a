"""fp16 with dynamic loss scaling: megatron-core's schedule runs the backward, DeepSpeed keeps the scale.

DeepSpeed's ZeRO optimizers own the loss scale (runtime/fp16/loss_scaler.py, DynamicLossScaler):
they unscale the gradients, look for inf/NaN on every rank (all-reduced over DP and the model-
parallel group, so all ranks agree), skip the step and lower the scale on overflow, and raise it
after `window` clean steps. What they need from the backward is a loss multiplied by that scale,
and to know that the multiplication happened:

* megatron-core calls `config.grad_scale_func(loss)` before the backward of each micro-batch,
  only on the last pipeline stage (pipeline_parallel/schedules.py:477-478). It is wired to
  `engine.scale` (deepspeed/runtime/engine.py:3338), DeepSpeed's manual-backward API, which both
  scales and records that the backward is expected; a bare multiply by the scale makes DeepSpeed's
  backward hook raise (engine.py:3205-3210: "Loss scaling is required ...").
* Earlier stages start their backward from the received gradient, already scaled by the last
  stage, and never call grad_scale_func: a hook on the stage's output tells DeepSpeed the same
  (the flag `engine.scale` sets), each time that output's backward begins.

`LossScaleWatch` reports the scale and the skipped steps, and stops a run that overflows on
`max_consecutive_skips` steps in a row (a model that has diverged, not a scale still settling).
"""

from __future__ import annotations

from toolkit.errors import ToolkitError


class LossScaleError(ToolkitError):
    """fp16 training that cannot continue: every recent step overflowed."""


def fp16_ds_settings(cfg) -> dict:
    """The recipe's `loss_scale.*` as DeepSpeed's fp16 block (runtime/precision_config.py)."""
    s = cfg.loss_scale
    return {"loss_scale": 0, "initial_scale_power": s.initial_scale_power, "loss_scale_window": s.window,
            "hysteresis": s.hysteresis, "min_loss_scale": s.min_scale}


def wire(engine, model, cfg) -> LossScaleWatch:
    """Let megatron-core's backward scale the loss the way DeepSpeed's step unscales it."""
    from megatron.core import parallel_state as ps

    model.config.grad_scale_func = engine.scale
    if not ps.is_pipeline_last_stage():
        model.register_forward_hook(lambda module, args, output: _expect_scaled_backward(engine, output))
    return LossScaleWatch(engine, cfg.loss_scale.max_consecutive_skips)


def _expect_scaled_backward(engine, output) -> None:
    if output.requires_grad:
        output.register_hook(lambda grad: _mark(engine, grad))


def _mark(engine, grad):
    engine._manual_backward_expected = True  # what engine.scale() records (engine.py:3377)
    return grad


class LossScaleWatch:
    def __init__(self, engine, max_consecutive_skips: int):
        self.engine = engine
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive = 0

    def after_step(self, step: int) -> dict:
        """The scale the next step uses and the run's skipped steps; raises after too many in a row."""
        skipped = not self.engine.was_step_applied()
        self.consecutive = self.consecutive + 1 if skipped else 0
        if self.consecutive >= self.max_consecutive_skips:
            raise LossScaleError(f"fp16: the last {self.consecutive} steps (up to step {step}) all overflowed and were "
                                 f"skipped; loss scale now {self.engine.optimizer.loss_scale:g}. The run has diverged "
                                 "or fp16 cannot represent it: lower optim.lr, or train in bf16 or fp32")
        return {"loss_scale": float(self.engine.optimizer.loss_scale), "skipped_steps": int(self.engine.skipped_steps),
                "step_skipped": skipped}
