"""Setup -> DeepSpeed JSON (a dict), consistent by construction.

Every value whose default moved between DeepSpeed releases is written out, so the same file means
the same thing on every version that accepts it. Bucket sizes come from the model's hidden size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.dsconfig import rules
from toolkit.bounds import first_problem
from toolkit.dsconfig.settings import DECAYING_SCHEDULERS, SCHEDULE_MEGATRON, SCHEDULERS, Setup
from toolkit.errors import ConfigError, ConversionError

if TYPE_CHECKING:
    from toolkit.families.spec import ModelSpec

AUTO = "auto"

# Bucket sizes from the hidden size h, the rules transformers uses when it fills DeepSpeed's "auto"
# values (integrations/deepspeed.py, trainer_config_finalize): reduce bucket h^2, ZeRO-3 prefetch
# int(0.9 h^2), parameters below 10 h elements stay resident. We use h^2 for all-gather too.
REDUCE_BUCKET_PER_H2 = 1.0
PREFETCH_BUCKET_PER_H2 = 0.9
PERSISTENCE_THRESHOLD_PER_H = 10
# DeepSpeed's own defaults, pinned (runtime/zero/config.py): gathered ZeRO-3 parameters kept live,
# and the optimizer sub-group size.
MAX_LIVE_PARAMETERS = 1_000_000_000
MAX_REUSE_DISTANCE = 1_000_000_000
SUB_GROUP_SIZE = 1_000_000_000
# Dynamic loss scaling for fp16, DeepSpeed's defaults (runtime/precision_config.py), pinned.
FP16_DYNAMIC_LOSS_SCALE = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
# NVMe swapping defaults (runtime/swap_tensor/aio_config.py), pinned.
AIO = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True, "use_gds": False}


def validate(setup: Setup, spec: "ModelSpec | None" = None) -> None:
    """Raise ConfigError for the first rule the setup breaks."""
    # In order, and lazily: later rules assume the earlier ones hold (e.g. DP >= 1).
    checks = (
        lambda: first_problem(setup),
        lambda: first_problem(setup.optimizer),
        lambda: setup.scheduler and first_problem(setup.scheduler),
        lambda: rules.layout(setup.gpus, setup.tp, setup.pp),
        lambda: None if setup.zero in (0, 1, 2, 3) else f"ZeRO stage must be 0, 1, 2 or 3 (got {setup.zero})",
        lambda: rules.precision([setup.precision]),
        lambda: rules.hf_trainer(setup.hf_trainer, setup.tp, setup.pp),
        lambda: rules.global_batch(setup.samples_per_step, setup.micro_batch, setup.dp),
        lambda: rules.pipeline_zero(setup.pp, setup.zero),
        lambda: rules.virtual_pipeline(setup.pp, setup.vpp, setup.micro_batches, None, setup.schedule),
        lambda: rules.overlap(setup.zero, setup.schedule, setup.overlap_comm, setup.reduce_bucket_size),
        lambda: rules.offload(setup.zero, setup.offload_optimizer, setup.offload_param, setup.nvme_path),
        lambda: rules.megatron_schedule(setup.schedule, bool(setup.monitoring.wandb_project),
                                        setup.activation_checkpointing, setup.hf_trainer),
        lambda: _scheduler_problem(setup),
    )
    for rule in checks:
        problem = rule()
        if problem:
            raise ConfigError(problem)
    if spec is not None:
        _check_model_layout(setup, spec)
    elif not setup.hf_trainer:
        raise ConfigError("a model is needed to size DeepSpeed's buckets from its hidden size")


def build(setup: Setup, spec: "ModelSpec | None" = None) -> dict:
    """The DeepSpeed config for `setup`; `spec` sizes the buckets (not needed with hf_trainer)."""
    validate(setup, spec)
    config = _batch(setup)
    config.update(
        gradient_clipping=AUTO if setup.hf_trainer else setup.gradient_clipping,
        steps_per_print=setup.steps_per_print,
        wall_clock_breakdown=False,
    )
    config.update(_precision(setup.precision))
    config["zero_optimization"] = _zero(setup, spec)
    if setup.offload_optimizer == "nvme" or setup.offload_param == "nvme":
        config["aio"] = dict(AIO)
    config["optimizer"] = _optimizer(setup)
    if setup.scheduler is not None and not setup.hf_trainer:
        config["scheduler"] = _scheduler(setup)
    if setup.activation_checkpointing:
        config["activation_checkpointing"] = _activation_checkpointing()
    config.update(_monitoring(setup))
    return config


def _check_model_layout(setup: Setup, spec: "ModelSpec") -> None:
    from toolkit.layouts import Layout

    try:
        Layout(setup.tp, setup.pp).check(spec)
    except ConversionError as e:  # the same facts, but here they make a bad layout
        raise ConfigError(str(e)) from None
    problem = rules.virtual_pipeline(setup.pp, setup.vpp, num_layers=spec.num_layers)
    if problem:
        raise ConfigError(problem)


def _scheduler_problem(setup: Setup) -> str | None:
    sched = setup.scheduler
    if sched is None:
        return None
    if sched.type not in SCHEDULERS:
        return f"unknown scheduler {sched.type!r}; choose one of {', '.join(SCHEDULERS)}"
    if sched.total_steps is None:
        if sched.type in DECAYING_SCHEDULERS:
            return (f"{sched.type} decays the LR to its minimum at the last step, so it needs the total number of "
                    "steps (--total-steps); without it, use a constant LR (with optional warmup)")
        return None
    if sched.warmup_steps > sched.total_steps:
        return f"need warmup steps ({sched.warmup_steps}) <= total steps ({sched.total_steps})"
    return None


def _batch(setup: Setup) -> dict:
    if setup.hf_trainer:
        return {"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO}
    if setup.schedule == SCHEDULE_MEGATRON:
        # megatron-core runs the micro-batches and already divides each loss by their number;
        # DeepSpeed must see one step per global batch, or it divides the gradients again.
        return {
            "train_batch_size": setup.samples_per_step,
            "train_micro_batch_size_per_gpu": setup.micro_batch * setup.micro_batches,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
        }
    return {
        "train_batch_size": setup.samples_per_step,
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "gradient_accumulation_steps": setup.micro_batches,
        "managed_gradient_accumulation": True,
    }


def _precision(precision: str) -> dict:
    if precision in ("bf16", "fp8"):  # fp8: the GEMMs' (toolkit.fp8), on bf16 weights DeepSpeed masters in fp32
        # check_grad_overflow pinned: its default changed to true in DeepSpeed PR #8035.
        return {"bf16": {"enabled": True, "check_grad_overflow": True}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, **FP16_DYNAMIC_LOSS_SCALE}}
    return {}


def _zero(setup: Setup, spec: "ModelSpec | None") -> dict:
    stage = setup.zero
    if stage == 0:
        return {"stage": 0}
    auto = setup.hf_trainer
    h2 = spec.hidden_size**2 if spec else 0
    zero = {
        "stage": stage,
        # DeepSpeed's default is true for ZeRO-3 only; with managed_gradient_accumulation=false it
        # must be false below ZeRO-2 (engine assertion), so pin it for every stage.
        "overlap_comm": stage >= 2 if setup.overlap_comm is None else setup.overlap_comm,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": AUTO if auto else int(REDUCE_BUCKET_PER_H2 * h2),
    }
    if setup.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = setup.reduce_bucket_size
    if stage < 3:
        zero.update(allgather_partitions=True, allgather_bucket_size=AUTO if auto else int(REDUCE_BUCKET_PER_H2 * h2))
    else:
        zero.update(
            stage3_prefetch_bucket_size=AUTO if auto else int(PREFETCH_BUCKET_PER_H2 * h2),
            stage3_param_persistence_threshold=AUTO if auto else PERSISTENCE_THRESHOLD_PER_H * spec.hidden_size,
            stage3_max_live_parameters=MAX_LIVE_PARAMETERS,
            stage3_max_reuse_distance=MAX_REUSE_DISTANCE,
            sub_group_size=SUB_GROUP_SIZE,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if setup.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(setup.offload_optimizer, setup.nvme_path)
    if setup.offload_param != "none":
        zero["offload_param"] = _offload(setup.offload_param, setup.nvme_path)
    return zero


def _offload(device: str, nvme_path: str | None) -> dict:
    block = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block


def _optimizer(setup: Setup) -> dict:
    opt = setup.optimizer
    if setup.hf_trainer:
        params = {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}
    else:
        params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    if opt.torch_adam:
        params["torch_adam"] = True
    return {"type": opt.type, "params": params}


def _scheduler(setup: Setup) -> dict:
    sched, lr = setup.scheduler, setup.optimizer.lr
    # DeepSpeed's warmup schedulers need warmup_num_steps >= 1 (and warm up over max(2, n) steps);
    # no warmup is a "warmup" that starts at the peak LR. warmup_type pinned: the default is log.
    steps = max(1, sched.warmup_steps)
    start = 0.0 if sched.warmup_steps else 1.0  # fraction of the peak LR at step 0
    warmup = {"warmup_num_steps": steps, "warmup_type": "linear"}
    if sched.type == "WarmupCosineLR":
        params = {"total_num_steps": sched.total_steps, "warmup_min_ratio": start, "cos_min_ratio": sched.min_lr_ratio}
    else:
        params = {"warmup_min_lr": start * lr, "warmup_max_lr": lr}
        if sched.type == "WarmupDecayLR":
            params["total_num_steps"] = sched.total_steps
    return {"type": sched.type, "params": {**params, **warmup}}


def lr_summary(setup: Setup) -> str:
    """The learning rate the config gives, in words, for the line the CLI prints."""
    if setup.hf_trainer:
        return "LR and schedule from the HF Trainer's arguments"
    lr, sched = setup.optimizer.lr, setup.scheduler
    warmup = f" after {sched.warmup_steps} warmup steps" if sched and sched.warmup_steps else ""
    if sched is None or sched.type == "WarmupLR":
        return f"constant LR {lr:g}{warmup}"
    final = lr * sched.min_lr_ratio if sched.type == "WarmupCosineLR" else 0.0
    shape = "cosine" if sched.type == "WarmupCosineLR" else "linear"
    return f"{shape} LR decay from {lr:g}{warmup} to {final:g} at step {sched.total_steps}"


def _activation_checkpointing() -> dict:
    # DeepSpeed's defaults, pinned (runtime/activation_checkpointing/config.py).
    return {
        "partition_activations": False,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


def _monitoring(setup: Setup) -> dict:
    mon, blocks = setup.monitoring, {}
    if mon.tensorboard_dir:
        blocks["tensorboard"] = {"enabled": True, "output_path": mon.tensorboard_dir, "job_name": mon.job_name}
    if mon.csv_dir:
        blocks["csv_monitor"] = {"enabled": True, "output_path": mon.csv_dir, "job_name": mon.job_name}
    if mon.wandb_project:
        blocks["wandb"] = {"enabled": True, "project": mon.wandb_project}
        if mon.wandb_group:
            blocks["wandb"]["group"] = mon.wandb_group
    return blocks
