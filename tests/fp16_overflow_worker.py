"""The recipe under torchrun with an overflow planted from the test side (never a product hook):

    torchrun ... tests/fp16_overflow_worker.py --config R.yaml [overrides]

FP16_INF_RANK, FP16_INF_STEPS ("11,13-": step 11, and 13 onwards): on that rank the first
micro-batch's loss of those steps is multiplied by inf before backward. Every rank appends
{"step", "skipped", "loss_scale"} per step to FP16_RECORD_DIR/rank<R>.jsonl, read from its own engine.
FP16_WITHOUT_STAGE_HOOK=1 (the guard): earlier pipeline stages do not mark their backward as scaled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _steps(spec: str):
    def planted(step: int) -> bool:
        for part in spec.split(","):
            first, dash, last = part.partition("-")
            if int(first) <= step and (step <= int(last or step) if dash else step == int(first)):
                return True
        return False

    return planted


def patch() -> None:
    from toolkit.train import loss as loss_lib
    from toolkit.train import loss_scale
    from toolkit.train import step as step_lib

    if os.environ.get("FP16_WITHOUT_STAGE_HOOK") == "1":
        loss_scale._expect_scaled_backward = lambda engine, output: None

    rank, record = int(os.environ["RANK"]), Path(os.environ["FP16_RECORD_DIR"]) / f"rank{os.environ['RANK']}.jsonl"
    planted, inf_rank = _steps(os.environ["FP16_INF_STEPS"]), int(os.environ["FP16_INF_RANK"])
    state = {"step": 0, "microbatch": 0}
    scaled_loss, train_step = loss_lib.scaled_loss, step_lib.train_step

    def scaled_with_inf(*args, **kwargs):
        scaled, total = scaled_loss(*args, **kwargs)
        state["microbatch"] += 1
        if rank == inf_rank and planted(state["step"]) and state["microbatch"] == 1 and scaled.requires_grad:
            scaled = scaled * float("inf")
        return scaled, total

    def recorded_train_step(engine, *args, **kwargs):
        state["step"] += 1
        state["microbatch"] = 0
        result = train_step(engine, *args, **kwargs)
        with record.open("a") as f:
            f.write(json.dumps({"step": state["step"], "skipped": not engine.was_step_applied(),
                                "loss_scale": float(engine.optimizer.loss_scale)}) + "\n")
        return result

    loss_lib.scaled_loss, step_lib.train_step = scaled_with_inf, recorded_train_step


if __name__ == "__main__":
    patch()
    sys.argv[0] = str(REPO / "recipes" / "finetune.py")
    sys.path.insert(0, str(REPO / "recipes"))
    import finetune

    raise SystemExit(finetune.main())
