"""The optimizer and LR scheduler a config names: DeepSpeed instantiates them only in
deepspeed.initialize, so a wrong name or parameter passes DeepSpeedConfig and fails (TypeError,
ValueError, assertion) once the job has started. Checked against the classes DeepSpeed would
build (engine.py _configure_basic_optimizer, _scheduler_from_config).
"""

from __future__ import annotations

import inspect

from toolkit.dsconfig.report import WARNING, Report, did_you_mean

# Optimizer parameters DeepSpeed itself pops before calling the constructor
# (engine.py _configure_basic_optimizer / get_optimizer_configuration).
ADAM_META_PARAMS = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}


def check_optimizer(config: dict, stage: int, offload: bool, report: Report) -> None:
    """optimizer.type must name a class DeepSpeed can build, its params that class's arguments."""
    block = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else {}
    name = block.get("type")
    if not isinstance(name, str):
        return
    cls, meta = _optimizer_class(name, offload)
    if cls is None:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        report.add("unknown-optimizer", "optimizer.type",
                   f"'{name}' is neither a DeepSpeed optimizer nor in torch.optim"
                   f"{did_you_mean(name, DEEPSPEED_OPTIMIZERS + ['AdamW', 'Adam', 'SGD'])}")
        return
    params = block.get("params") or {}
    if isinstance(params, dict):
        _optimizer_params(cls, meta, params, report)
    _untested_with_zero(config, cls, stage, report)


def _optimizer_class(name: str, offload: bool):
    """The class DeepSpeed instantiates for optimizer.type (engine._configure_basic_optimizer)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    lower = name.lower()
    if lower not in DEEPSPEED_OPTIMIZERS:
        return getattr(torch.optim, name, None), set()
    if lower in ("adam", "adamw"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return (DeepSpeedCPUAdam if offload else FusedAdam), ADAM_META_PARAMS
    if lower == "adagrad":
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return (DeepSpeedCPUAdagrad if offload else torch.optim.Adagrad), set()
    if lower == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb, set()
    if lower == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion if offload else FusedLion), set()
    return object, None  # mup / muon: parameters not checked


def _optimizer_params(cls, meta, params: dict, report: Report) -> None:
    if meta is None:
        return
    if "max_grad_norm" in params:
        report.add("optimizer-param", "optimizer.params.max_grad_norm",
                   "DeepSpeed raises on max_grad_norm; use the top-level gradient_clipping")
    if params.get("torch_adam"):
        import torch

        cls = torch.optim.AdamW
        meta = meta | {"foreach"}
    accepted = _signature_params(cls) | meta
    for key in params:
        if key not in accepted and key != "max_grad_norm":
            report.add("optimizer-param", f"optimizer.params.{key}",
                       f"{cls.__name__} takes no '{key}' (TypeError in deepspeed.initialize)"
                       f"{did_you_mean(key, accepted)}")


def _untested_with_zero(config: dict, cls, stage: int, report: Report) -> None:
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    if stage == 0 or cls is object or cls in ZERO_SUPPORTED_OPTIMIZERS:
        return
    if config.get("zero_allow_untested_optimizer") is True:
        return
    report.add("untested-optimizer", "optimizer.type",
               f"ZeRO with {cls.__name__} asserts in deepspeed.initialize unless \"zero_allow_untested_optimizer\": true")


def _signature_params(cls) -> set[str]:
    skip = {"self", "params", "model_params", "args", "kwargs"}
    return {p for p in inspect.signature(cls.__init__).parameters if p not in skip}


def check_scheduler(config: dict, report: Report) -> None:
    """scheduler.type must be a DeepSpeed or torch LR scheduler, its params its arguments."""
    block = config.get("scheduler") if isinstance(config.get("scheduler"), dict) else {}
    name = block.get("type")
    if not isinstance(name, str):
        return
    import torch
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        report.add("scheduler", "scheduler.type", f"DeepSpeed does not recognise LR scheduler '{name}'"
                   f"{did_you_mean(name, lr_schedules.VALID_LR_SCHEDULES)}")
        return
    params = block.get("params") or {}
    if not isinstance(params, dict):
        return
    signature = inspect.signature(cls.__init__).parameters
    accepted = {p for p in signature if p not in ("self", "optimizer")}
    for key in params:
        if key not in accepted:
            report.add("scheduler", f"scheduler.params.{key}",
                       f"{name} takes no '{key}' (TypeError in deepspeed.initialize){did_you_mean(key, accepted)}")
    missing = [p for p in accepted if signature[p].default is inspect.Parameter.empty and p not in params
               and signature[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    for key in missing:
        report.add("scheduler", f"scheduler.params.{key}", f"{name} needs '{key}'")
    _warmup_steps(name, params, signature, report)


def _warmup_steps(name: str, params: dict, signature, report: Report) -> None:
    """DeepSpeed's warmup schedulers raise unless warmup_num_steps is a positive int, and default
    it to 1000 (lr_schedules.py WarmupLR / WarmupCosineLR)."""
    if "warmup_num_steps" not in signature:
        return
    steps = params.get("warmup_num_steps")
    if steps is None:
        default = signature["warmup_num_steps"].default
        report.add("unpinned-default", "scheduler.params.warmup_num_steps",
                   f"not set: {name} warms up for {default} steps by default; write the value you mean", WARNING)
    elif isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        report.add("scheduler", "scheduler.params.warmup_num_steps",
                   f"{name} raises unless warmup_num_steps is a positive integer (got {steps!r}); for no "
                   "warmup use 1 with a warmup start LR equal to the peak")
