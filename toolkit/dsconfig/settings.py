"""What a user asks for when generating a DeepSpeed config: a typed tree with defaults.

`Setup` describes one training run on a cluster: the layout (GPUs, TP, PP, derived DP), ZeRO and
offload, precision, the batch in the usual terms (micro-batch, global batch), the optimizer, the
LR schedule and monitoring. `build()` turns it into DeepSpeed JSON; nothing here knows DeepSpeed's
key names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.bounds import bounded

# fp8: FP8 GEMMs inside the model (toolkit.fp8) on bf16 weights; DeepSpeed's side is bf16's
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Who runs the micro-batches of one optimizer step.
SCHEDULE_DEEPSPEED = "deepspeed"  # DeepSpeed counts micro-steps (plain DeepSpeed, HF users)
SCHEDULE_MEGATRON = "megatron"  # megatron-core's pipeline schedule; DeepSpeed sees one step per batch
SCHEDULES = (SCHEDULE_DEEPSPEED, SCHEDULE_MEGATRON)

SCHEDULERS = ("WarmupCosineLR", "WarmupDecayLR", "WarmupLR")
# The schedules that decay the LR to their minimum at total_num_steps: they need a step count.
DECAYING_SCHEDULERS = ("WarmupCosineLR", "WarmupDecayLR")


@dataclass(frozen=True)
class OptimizerSettings:
    type: str = "AdamW"
    lr: float = bounded(1e-5, ge=0)
    betas: tuple[float, float] = bounded((0.9, 0.95), ge=0, lt=1, length=2)
    eps: float = bounded(1e-8, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    # torch.optim.AdamW instead of DeepSpeed's FusedAdam: no JIT build (CPU, CI).
    torch_adam: bool = False


@dataclass(frozen=True)
class SchedulerSettings:
    type: str = "WarmupLR"
    warmup_steps: int = bounded(0, integer=True, ge=0)
    # Steps of the whole run; the decaying schedules reach their minimum here, so they need it.
    total_steps: int | None = bounded(None, integer=True, ge=1, optional=True)
    # Final LR as a fraction of the peak LR (WarmupCosineLR's cos_min_ratio; 0 for the others).
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)


@dataclass(frozen=True)
class Monitoring:
    tensorboard_dir: str | None = None
    csv_dir: str | None = None
    wandb_project: str | None = None
    wandb_group: str | None = None
    job_name: str = "toolkit"


@dataclass(frozen=True)
class Setup:
    gpus: int = bounded(integer=True, ge=1)
    tp: int = bounded(1, integer=True, ge=1)
    pp: int = bounded(1, integer=True, ge=1)
    # virtual pipeline stages per PP rank (megatron-core's interleaved 1F1B; toolkit.train.virtual)
    vpp: int = bounded(1, integer=True, ge=1)
    zero: int = 1
    precision: str = "bf16"
    micro_batch: int = bounded(1, integer=True, ge=1)
    # Samples per optimizer step over all data-parallel ranks; None means micro_batch * DP.
    global_batch: int | None = bounded(None, integer=True, ge=1, optional=True)
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    # ZeRO's overlap of gradient reduction with backward; None: on at ZeRO-2/3, off at ZeRO-1
    # (where megatron-core's schedule makes DeepSpeed assert). Buckets: None sizes them from the model.
    overlap_comm: bool | None = None
    reduce_bucket_size: int | None = bounded(None, integer=True, ge=1, optional=True)
    schedule: str = SCHEDULE_DEEPSPEED
    activation_checkpointing: bool = False
    # Pinned: DeepSpeed's default moved from 0.0 (off) to 1.0 in ~0.19.3 (PR #8068).
    gradient_clipping: float = bounded(1.0, ge=0)
    steps_per_print: int = bounded(100, integer=True, ge=1)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    # None: a constant LR (no DeepSpeed scheduler block).
    scheduler: SchedulerSettings | None = None
    monitoring: Monitoring = field(default_factory=Monitoring)
    # Emit "auto" values for the HF Trainer / Accelerate to fill in.
    hf_trainer: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.gpus // self.model_parallel

    @property
    def samples_per_step(self) -> int:
        return self.global_batch if self.global_batch is not None else self.micro_batch * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.samples_per_step // (self.micro_batch * self.dp)
