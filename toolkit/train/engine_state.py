"""The few numbers of a DeepSpeed engine that a resume needs besides the weights, Adam's state and
the LR schedule: its step counters and, in fp16, the dynamic loss scale. DeepSpeed keeps the counters
in its model-states file and the loss scale in its ZeRO optimizer files, which a full fine-tune does
not write (train/ holds the optimizer state): they travel in train_state.json instead, so every
resume, on any layout, continues them."""

from __future__ import annotations

COUNTERS = ("global_steps", "global_samples", "skipped_steps")
# DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py): what changes as training goes.
LOSS_SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def read(engine) -> dict:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    dynamic = scaler is not None and getattr(scaler, "dynamic", False)
    return {"engine_counters": {name: int(getattr(engine, name)) for name in COUNTERS if hasattr(engine, name)},
            "loss_scale": {name: getattr(scaler, name) for name in LOSS_SCALE} if dynamic else None}


def restore(engine, state: dict) -> None:
    """From train_state.json; checkpoints of earlier versions carry neither (the engine's start values stay)."""
    for name, value in (state.get("engine_counters") or {}).items():
        setattr(engine, name, value)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for name, value in (state.get("loss_scale") or {}).items():
        setattr(scaler, name, value)
