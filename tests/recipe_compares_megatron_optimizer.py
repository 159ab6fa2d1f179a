"""The fine-tuning recipe stopped just before its first step, to compare its DeepSpeed engine with
a Megatron-LM checkpoint's optimizer state (model.optimizer_state): every parameter's fp32 master,
exp_avg and exp_avg_sq on this rank against megatron-core's own read of the saved tensors
(dist_checkpointing.load of the model's sharded_state_dict under the optimizer's keys, not the
toolkit's reader), and Adam's step count. Each rank writes what differs to $CHECK_REPORT/rank_N.json
and the run ends there (nothing else written). Patched here, so the product has no test switch."""

import json
import os
import runpy
from dataclasses import replace
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"
STATES = ("param", "exp_avg", "exp_avg_sq")


def megatron_saved(model, state: str, directory: str) -> dict:
    """This rank's TP/PP part of every parameter's `state`, as megatron-core reads it."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded = model.sharded_state_dict()
    template = {}
    for name, param in model.named_parameters():
        entry = sharded[name]
        fields = {"key": f"optimizer.state.{state}.{entry.key}", "data": torch.empty(param.shape, dtype=torch.float32)}
        template[name] = replace(entry, **fields, **({"dtype": torch.float32} if isinstance(entry, ShardedTensor) else {}))
    return dist_checkpointing.load(template, directory)


def engine_state(param, state: str, adam_created: bool):
    """DeepSpeed's full fp32 copy of this rank's parameter (its ZeRO fragments put together); a
    moment Adam has not created yet (before its first step) is zero, as AdamW starts it."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if state == "param":
        return safe_get_full_fp32_param(param).float().cpu()
    return safe_get_full_optimizer_state(param, state).float().cpu() if adam_created else torch.zeros(param.shape)


def check_then_stop(engine, model, *args, **kwargs):
    import torch
    import torch.distributed as dist

    from toolkit.runtime.distributed import shutdown

    directory = os.environ["MEGATRON_CHECKPOINT"]
    base = engine.optimizer.optimizer
    adam_created = any(base.state.values())
    report = {"differ": {}, "parameters": [], "adam_steps": sorted({int(s["step"]) for s in base.state.values() if s})}
    for state in STATES:
        saved = megatron_saved(model, state, directory)
        report["differ"][state] = [name for name, param in model.named_parameters()
                                   if not torch.equal(engine_state(param, state, adam_created), saved[name])]
        report["parameters"] = sorted(name for name, _ in model.named_parameters())
    out = Path(os.environ["CHECK_REPORT"]) / f"rank_{dist.get_rank()}.json"
    out.write_text(json.dumps(report))
    dist.barrier()
    shutdown()
    raise SystemExit(0)


if __name__ == "__main__":
    from toolkit.train import step

    step.train_step = check_then_stop
    runpy.run_path(str(RECIPE), run_name="__main__")
