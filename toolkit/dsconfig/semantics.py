"""Cross-field rules of a DeepSpeed config: what only fails in deepspeed.initialize, at the first
step, or never (silently doing something else).

Values are read the way DeepSpeed resolves them (defaults included); a value of the wrong type
was reported by the key pass and is skipped here.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.dsconfig import optimizers, rules
from toolkit.dsconfig.report import WARNING, Report


def _int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _dict(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Facts:
    train_batch: int | None
    micro: int | None
    gas: int | None
    autos: bool
    managed: bool
    stage: int
    overlap_comm: bool
    fp16: bool
    bf16: bool
    optimizer_device: str
    param_device: str
    nvme_path: str | None

    @classmethod
    def read(cls, config: dict) -> "Facts":
        zero = _dict(config, "zero_optimization")
        stage = _int(zero.get("stage", 0)) or 0
        opt, par = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
        opt, par = (x if isinstance(x, dict) else {} for x in (opt, par))
        overlap = zero.get("overlap_comm")
        batch = [config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
        return cls(
            train_batch=_int(batch[0]),
            micro=_int(batch[1]),
            gas=_int(batch[2]),
            autos="auto" in batch,
            managed=config.get("managed_gradient_accumulation", True) is not False,
            stage=stage,
            overlap_comm=overlap if isinstance(overlap, bool) else stage == 3,  # DeepSpeed's dynamic default
            fp16=_dict(config, "fp16").get("enabled") is True,
            bf16=(_dict(config, "bf16") or _dict(config, "bfloat16")).get("enabled") is True,
            optimizer_device=str(opt.get("device", "none")),
            param_device=str(par.get("device", "none")),
            nvme_path=opt.get("nvme_path") or par.get("nvme_path"),
        )


def check(config: dict, report: Report, gpus: int | None, tp: int, pp: int, hf_trainer: bool) -> None:
    facts = Facts.read(config)
    dp = _data_parallel(gpus, tp, pp, report)
    _batch(facts, dp, report)
    _add(report, "pipeline-zero", "zero_optimization.stage", rules.pipeline_zero(pp, facts.stage))
    _add(report, "bf16-and-fp16", "", rules.precision(["bf16"] * facts.bf16 + ["fp16"] * facts.fp16))
    _add(report, "offload-stage", "zero_optimization",
         rules.offload(facts.stage, facts.optimizer_device, facts.param_device, facts.nvme_path))
    if facts.gas is not None:
        _add(report, "unmanaged-accumulation", "managed_gradient_accumulation",
             rules.unmanaged_accumulation(facts.managed, facts.stage, facts.overlap_comm, facts.gas))
    _grad_accum_dtype(config, facts, report)
    _stage_requirements(config, facts, report)
    optimizers.check_optimizer(config, facts.stage, facts.optimizer_device != "none", report)
    optimizers.check_scheduler(config, report)
    if not hf_trainer:
        _pinned_defaults(config, facts, report)
    if _dict(config, "wandb").get("enabled") is True:
        report.add("wandb-monitor", "wandb", "DeepSpeed's monitor calls wandb.init itself (no run name, config or "
                   "resume); a trainer that logs to W&B on its own loses its run to it", WARNING)


def _add(report: Report, kind: str, path: str, message: str | None) -> None:
    if message:
        report.add(kind, path, message)


def _data_parallel(gpus: int | None, tp: int, pp: int, report: Report) -> int | None:
    if gpus is None:
        return None
    problem = rules.layout(gpus, tp, pp)
    if problem:
        report.add("layout", "", problem)
        return None
    dp = gpus // (tp * pp)
    report.notes.append(f"{gpus} GPUs = TP {tp} x PP {pp} x DP {dp}")
    return dp


def _batch(f: Facts, dp: int | None, report: Report) -> None:
    if f.autos:
        return
    if f.train_batch is None and f.micro is None:
        report.add("batch-missing", "", "give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed asserts); "
                   "best all three, consistent for the data-parallel size")
        return
    values = {"train_batch_size": f.train_batch, "train_micro_batch_size_per_gpu": f.micro,
              "gradient_accumulation_steps": f.gas}
    for key, value in values.items():
        if value is not None and value < 1:
            report.add("batch-mismatch", key, f"must be >= 1 (got {value})")
            return
    if dp is None:
        _batch_without_layout(f, report)
        return
    tbs, micro, gas = _infer_like_deepspeed(f.train_batch, f.micro, f.gas, dp)
    _add(report, "batch-mismatch", "train_batch_size", rules.batch_invariant(tbs, micro, gas, dp))


def _batch_without_layout(f: Facts, report: Report) -> None:
    if None in (f.train_batch, f.micro, f.gas):
        report.notes.append("batch values depend on the data-parallel size; pass --gpus (and --tp/--pp) to check them")
        return
    per_rank = f.micro * f.gas
    if f.train_batch % per_rank:
        report.add("batch-mismatch", "train_batch_size",
                   f"{f.train_batch} is not a multiple of micro-batch x accumulation = {per_rank}: no data-parallel "
                   "size satisfies DeepSpeed's batch assertion")
    else:
        report.notes.append(f"the batch values imply DP = {f.train_batch // per_rank}")


def _infer_like_deepspeed(tbs, micro, gas, dp):
    """DeepSpeedConfig._set_batch_related_parameters, with integer floor division as it does."""
    if tbs is not None and micro is not None and gas is None:
        gas = tbs // micro // dp
    elif tbs is not None and gas is not None and micro is None:
        micro = tbs // dp // gas
    elif micro is not None and gas is not None and tbs is None:
        tbs = micro * gas * dp
    elif tbs is not None and micro is None:
        gas, micro = 1, tbs // dp
    elif micro is not None and tbs is None:
        tbs, gas = micro * dp, 1
    return tbs, micro, gas


def _grad_accum_dtype(config: dict, f: Facts, report: Report) -> None:
    accum = _dict(config, "data_types").get("grad_accum_dtype")
    model = "bf16" if f.bf16 else "fp16" if f.fp16 else "fp32"
    if accum is None or f.stage != 0 or _dtype_name(accum) == model:
        return
    report.add("grad-accum-dtype", "data_types.grad_accum_dtype",
               f"{model} parameters with {accum} gradient accumulation need ZeRO-1 or higher; ZeRO-0 raises "
               "NotImplementedError in deepspeed.initialize")


def _stage_requirements(config: dict, f: Facts, report: Report) -> None:
    """The option/stage pairs DeepSpeedConfig._do_error_check refuses (runtime/config.py)."""
    if config.get("gradient_allreduce_op") == "sum" and f.stage == 3:
        report.add("incompatible-options", "gradient_allreduce_op", "'sum' is not supported with ZeRO-3; use 'mean'")
    flags = (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
             ("bf16", "bf16_optimizer_states"))
    for block, key in flags:
        if _dict(config, block).get(key) is True and f.stage == 0:
            report.add("incompatible-options", f"{block}.{key}", "needs ZeRO stage 1, 2 or 3")
    bf16 = _dict(config, "bf16")
    if bf16.get("bf16_optimizer_states") is True and bf16.get("bf16_master_weights_and_grads") is not True:
        report.add("incompatible-options", "bf16.bf16_optimizer_states", "needs bf16_master_weights_and_grads: true")


def _dtype_name(name) -> str | None:
    aliases = {"fp16": ("fp16", "float16", "half", "torch.float16"), "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
               "fp32": ("fp32", "float32", "float", "torch.float32")}
    return next((k for k, names in aliases.items() if name in names), None)


def _pinned_defaults(config: dict, f: Facts, report: Report) -> None:
    if "gradient_clipping" not in config:
        report.add("unpinned-default", "gradient_clipping", "not set: DeepSpeed's default changed from 0.0 (off) "
                   "to 1.0 in ~0.19.3 (PR #8068); write the value you mean", WARNING)
    zero = _dict(config, "zero_optimization")
    if f.stage in (1, 2) and "overlap_comm" not in zero:
        report.add("unpinned-default", "zero_optimization.overlap_comm", "not set: DeepSpeed's default depends "
                   "on the stage (true only for ZeRO-3); write the value you mean", WARNING)
    params = _dict(_dict(config, "scheduler"), "params")
    if "warmup_num_steps" in params and "warmup_type" not in params:
        report.add("unpinned-default", "scheduler.params.warmup_type", "not set: DeepSpeed warms up "
                   "logarithmically by default; write \"linear\" or \"log\"", WARNING)
