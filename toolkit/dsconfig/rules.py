"""The compatibility rules a DeepSpeed layout must satisfy, in one place.

`build()` raises on the first broken rule; `check()` reports every broken rule of a JSON file.
Each function returns None when the rule holds, else a message that says what to change.
"""

from __future__ import annotations

from toolkit.dsconfig.settings import OFFLOAD_DEVICES, PRECISIONS, SCHEDULE_MEGATRON, SCHEDULES


def layout(gpus: int, tp: int, pp: int) -> str | None:
    if min(gpus, tp, pp) < 1:
        return f"GPUs, TP and PP must be >= 1 (got {gpus}, {tp}, {pp})"
    if gpus % (tp * pp):
        return (
            f"{gpus} GPUs cannot be split into model replicas of TP x PP = {tp} x {pp} = {tp * pp} GPUs "
            f"({gpus} % {tp * pp} = {gpus % (tp * pp)}); choose TP x PP dividing {gpus}"
        )
    return None


def global_batch(global_batch: int, micro: int, dp: int) -> str | None:
    if micro < 1 or global_batch < 1:
        return f"micro-batch and global batch must be >= 1 (got {micro}, {global_batch})"
    per_step = micro * dp
    if global_batch % per_step:
        lower = max(per_step, global_batch // per_step * per_step)
        return (
            f"global batch {global_batch} is not divisible by micro-batch x DP = {micro} x {dp} = {per_step}; "
            f"use {lower} or {lower + per_step}, or another micro-batch"
        )
    return None


def batch_invariant(train_batch: int, micro: int, gas: int, dp: int) -> str | None:
    """DeepSpeed's own assertion (runtime/config.py _batch_assertion), with DP as the world size."""
    if train_batch != micro * gas * dp:
        return (
            f"train_batch_size {train_batch} != train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP "
            f"= {micro} x {gas} x {dp} = {micro * gas * dp}; DeepSpeed checks this against the data-parallel size, "
            "not the GPU count"
        )
    return None


def pipeline_zero(pp: int, stage: int) -> str | None:
    if pp > 1 and stage >= 2:
        return (
            f"ZeRO-{stage} cannot be combined with pipeline parallelism (PP={pp}): DeepSpeed's PipelineEngine "
            "asserts 'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism', and under megatron-core's "
            "1F1B schedule ZeRO-2 fails in step() and ZeRO-3 deadlocks. Use ZeRO-1 with PP, or PP=1"
        )
    return None


def overlap(stage: int, schedule: str, overlap_comm: bool | None, reduce_bucket_size: int | None) -> str | None:
    """Communication overlap and bucket size where the stage and schedule use them (None: the
    generator's default, overlap on at ZeRO-2/3 and off at ZeRO-1)."""
    if stage == 0 and (overlap_comm is not None or reduce_bucket_size is not None):
        return ("overlap_comm and reduce_bucket_size are ZeRO settings: ZeRO-0 ignores them (no zero_optimization "
                "block is written); use ZeRO-1, 2 or 3, or leave them unset")
    if overlap_comm and stage == 1 and schedule == SCHEDULE_MEGATRON:
        return ("overlap_comm=true with ZeRO-1 under megatron-core's schedule: DeepSpeed 0.19.8 asserts "
                "'managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2' "
                "(so also with PP > 1, which is ZeRO-1 only); use ZeRO-2/3 (where it is on by default) or leave it off")
    return None


def offload(stage: int, optimizer_device: str, param_device: str, nvme_path: str | None = None) -> str | None:
    for what, device in (("optimizer", optimizer_device), ("parameter", param_device)):
        if device not in OFFLOAD_DEVICES:
            return f"{what} offload device must be one of {', '.join(OFFLOAD_DEVICES)} (got {device!r})"
    if stage == 0 and (optimizer_device, param_device) != ("none", "none"):
        return "offload needs ZeRO: ZeRO-0 ignores offload_optimizer/offload_param; use ZeRO-1 or higher"
    if param_device != "none" and stage < 3:
        return (
            f"parameter offload needs ZeRO-3 (ZeRO-{stage} silently keeps parameters on the GPU); use ZeRO-3, "
            "or offload the optimizer only"
        )
    if optimizer_device == "nvme" and stage < 3:
        return (
            f"NVMe optimizer offload needs ZeRO-3 (ZeRO-{stage} silently treats it as CPU offload); "
            "use ZeRO-3 or --offload-optimizer cpu"
        )
    if "nvme" in (optimizer_device, param_device) and not nvme_path:
        return "NVMe offload needs an nvme_path (a directory on a local NVMe drive)"
    return None


def precision(enabled: list[str]) -> str | None:
    unknown = [p for p in enabled if p not in PRECISIONS]
    if unknown:
        return f"unknown precision {unknown[0]!r}; choose one of {', '.join(PRECISIONS)}"
    if "bf16" in enabled and "fp16" in enabled:
        return "fp16 and bf16 cannot both be enabled (DeepSpeed asserts); choose one"
    if "fp8" in enabled and "fp16" in enabled:
        return ("FP8 with fp16 is not supported: FP8 trains on bf16 weights with fp32 masters (DeepSpeed's bf16 "
                "block); choose fp8")
    return None


def unmanaged_accumulation(managed: bool, stage: int, overlap_comm: bool, gas: int) -> str | None:
    """managed_gradient_accumulation=false: megatron-core's schedule runs the micro-batches."""
    if managed:
        return None
    if overlap_comm and stage < 2:
        return (
            f"managed_gradient_accumulation=false with overlap_comm=true needs ZeRO-2 or 3 (DeepSpeed asserts "
            f"in deepspeed.initialize); set zero_optimization.overlap_comm=false for ZeRO-{stage}"
        )
    if gas != 1:
        return (
            f"managed_gradient_accumulation=false with gradient_accumulation_steps={gas}: DeepSpeed would divide "
            "every gradient by it, on top of megatron-core's division by the number of micro-batches; set "
            "gradient_accumulation_steps=1 and train_micro_batch_size_per_gpu = micro-batch x micro-batches"
        )
    return None


def megatron_schedule(schedule: str, wandb: bool, activation_checkpointing: bool, hf_trainer: bool) -> str | None:
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
    if schedule != SCHEDULE_MEGATRON:
        return None
    if hf_trainer:
        return "--hf-trainer and the megatron-core schedule exclude each other: the HF Trainer runs its own loop"
    if wandb:
        return (
            "the toolkit's trainer logs to W&B itself; DeepSpeed's wandb monitor would call wandb.init first and "
            "take over the run. Drop the DeepSpeed wandb block (use the recipe's W&B options)"
        )
    if activation_checkpointing:
        return (
            "with the megatron-core schedule, activation recomputation is megatron-core's "
            "(TransformerConfig.recompute_granularity); DeepSpeed's activation_checkpointing block would be "
            "dead. Pass recompute to the recipe instead"
        )
    return None


def virtual_pipeline(pp: int, vpp: int, micro_batches: int | None = None, num_layers: int | None = None,
                     schedule: str = SCHEDULE_MEGATRON) -> str | None:
    """megatron-core's interleaved 1F1B: V model chunks per pipeline rank."""
    if vpp == 1:
        return None
    if pp == 1:
        return f"VPP {vpp} needs PP > 1: virtual stages interleave a pipeline"
    if schedule != SCHEDULE_MEGATRON:
        return f"VPP {vpp} is megatron-core's interleaved schedule; DeepSpeed's pipeline has none: use the megatron schedule"
    if num_layers is not None and num_layers % (pp * vpp):
        return (f"VPP {vpp}: the model's {num_layers} layers are not divisible by PP x VPP = {pp} x {vpp} "
                "(each virtual stage holds layers / (PP x VPP))")
    # schedules.py:995-1015: each chunk takes the micro-batches in groups of PP; a last, smaller
    # group is refused, and fewer than PP micro-batches too.
    if micro_batches is not None and (micro_batches < pp or micro_batches % pp):
        return (f"VPP {vpp}: the interleaved schedule needs the micro-batches per step (global batch / "
                f"(micro-batch x DP) = {micro_batches}) to be a multiple of PP = {pp}")
    return None


def hf_trainer(enabled: bool, tp: int, pp: int) -> str | None:
    if enabled and tp * pp > 1:
        return f"the HF Trainer runs data parallelism only; TP={tp} x PP={pp} needs the toolkit's recipe"
    return None
