"""Parameters, gradients and optimizer states one rank holds under DeepSpeed ZeRO.

The ZeRO paper's accounting (Rajbhandari et al. 2019, §3: 2 + 2 + 12 bytes per parameter for
mixed-precision Adam) is the starting point; the terms below are what DeepSpeed 0.19.8 actually
allocates, as measured on real engines (tests/test_memory_measured.py):

* ZeRO-1/2 keep a separate fp32 master partition even when training in fp32.
* ZeRO-1 reduces gradients into a partition during the backward of the boundary micro-step; when
  one optimizer step has several backward calls (DeepSpeed accumulation, or megatron-core's
  schedule with several micro-batches) the full gradients live in param.grad until the step.
* ZeRO-2/3 keep only the gradient partition.
* ZeRO-3 keeps parameters below stage3_param_persistence_threshold whole on every rank, and
  gathers the parameters of the module being computed (plus the prefetch bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4
MASTER_BYTES = 4  # fp32 master copy of the weights (ZeRO paper K = 12 = 4 master + 8 Adam)
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 (torch AdamW, FusedAdam, DeepSpeedCPUAdam)


@dataclass(frozen=True)
class ZeroSettings:
    """The parts of a config's zero_optimization block that change memory."""

    stage: int
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's defaults (runtime/zero/config.py)
    overlap_comm: bool = False
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @classmethod
    def from_config(cls, config: dict) -> "ZeroSettings":
        zero = config.get("zero_optimization") or {}
        stage = int(zero.get("stage", 0))
        defaults = cls(stage)
        return cls(
            stage=stage,
            reduce_bucket_size=int(zero.get("reduce_bucket_size", defaults.reduce_bucket_size)),
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", defaults.prefetch_bucket_size)),
            param_persistence_threshold=int(zero.get("stage3_param_persistence_threshold",
                                                     defaults.param_persistence_threshold)),
            max_live_parameters=int(zero.get("stage3_max_live_parameters", defaults.max_live_parameters)),
            sub_group_size=int(zero.get("sub_group_size", defaults.sub_group_size)),
            offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none"),
            offload_param=(zero.get("offload_param") or {}).get("device", "none"),
        )


@dataclass(frozen=True)
class ModelStates:
    params: int  # bytes on the GPU
    grads: int
    optimizer: int
    buffers: int  # communication buckets, gathered ZeRO-3 parameters, step temporaries
    host: int = 0  # bytes moved to CPU memory by offload
    nvme: int = 0  # bytes moved to NVMe by offload

    @property
    def gpu(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


def model_states(numels, weight_bytes: int, dp: int, zero: ZeroSettings,
                 backward_calls: int = 1) -> ModelStates:
    """Bytes one rank holds for its parameter tensors `numels` (weight_bytes: 2 for bf16/fp16,
    4 for fp32; backward_calls: backward passes per optimizer step on this rank)."""
    total = sum(numels)
    if zero.stage == 0:
        return _zero0(total, weight_bytes)
    if zero.stage in (1, 2):
        return _zero12(numels, weight_bytes, dp, zero, backward_calls)
    return _zero3(numels, weight_bytes, dp, zero)


def _zero0(total: int, w: int) -> ModelStates:
    # fp32: torch AdamW straight on the model. bf16/fp16: DeepSpeed's FP16 optimizer wrapper
    # keeps an fp32 master copy and builds fp32 gradients for it during step().
    mixed = w < FP32_BYTES
    optimizer = (MASTER_BYTES * mixed + ADAM_STATE_BYTES) * total
    return ModelStates(params=w * total, grads=w * total, optimizer=optimizer,
                       buffers=FP32_BYTES * total * mixed)


def _zero12(numels: list[int], w: int, dp: int, zero: ZeroSettings, backward_calls: int) -> ModelStates:
    total = sum(numels)
    part = -(-total // dp)
    full_grads = zero.stage == 1 and backward_calls > 1
    offload = zero.offload_optimizer != "none"
    grads = w * total if full_grads else 0 if offload else w * (part + boundary_overhang(numels, dp))
    optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * part
    # DeepSpeed builds the fp32 gradient partition the optimizer steps on (the "4 grads32" of
    # its own estimator); with offload it lives in host memory instead.
    step_grads = FP32_BYTES * part
    buckets = w * zero.reduce_bucket_size * (2 if zero.overlap_comm else 1)
    return _place(ModelStates(params=w * total, grads=grads, optimizer=optimizer, buffers=buckets + step_grads),
                  zero, offloaded_optimizer=optimizer + step_grads, gpu_step_grads=step_grads)


def boundary_overhang(numels: list[int], dp: int) -> int:
    """Extra gradient elements a ZeRO-1/2 rank holds: its gradient buffer keeps the whole of each
    tensor a partition boundary cuts (stage_1_and_2.py get_partition_info). A boundary falls in a
    tensor with probability proportional to its size, so on average a rank holds
    (dp - 1) / dp * sum(n^2) / sum(n) extra elements (none at DP 1)."""
    total = sum(numels)
    if dp == 1 or not total:
        return 0
    return int((dp - 1) / dp * sum(n * n for n in numels) / total)


def _zero3(numels: list[int], w: int, dp: int, zero: ZeroSettings) -> ModelStates:
    part = sum(-(-n // dp) for n in numels)
    persistent = sum(n for n in numels if n < zero.param_persistence_threshold)
    optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * part
    # ZeRO-3 steps one sub-group at a time, each with its fp32 gradient (stage3.py _prepare_sub_group).
    step_grads = FP32_BYTES * min(part, zero.sub_group_size)
    # The module being computed is gathered (and, in backward, its full gradient), plus what
    # the prefetcher has fetched ahead; never more than max_live_parameters.
    gathered = min(2 * max(numels, default=0) + zero.prefetch_bucket_size, zero.max_live_parameters)
    buffers = w * (zero.reduce_bucket_size + gathered) + step_grads
    params = w * (part + persistent)
    return _place(ModelStates(params=params, grads=w * part, optimizer=optimizer, buffers=buffers), zero,
                  offloaded_optimizer=optimizer + FP32_BYTES * part, offloaded_params=w * part,
                  gpu_step_grads=step_grads)


def _place(states: ModelStates, zero: ZeroSettings, offloaded_optimizer: int, gpu_step_grads: int,
           offloaded_params: int = 0) -> ModelStates:
    """Move what offload moves: optimizer states with their fp32 gradients, and ZeRO-3 parameter
    partitions."""
    host = nvme = 0
    params, optimizer, buffers, grads = states.params, states.optimizer, states.buffers, states.grads
    if zero.offload_optimizer != "none":
        optimizer, buffers = 0, buffers - gpu_step_grads
        if zero.stage == 3:
            grads = 0
        host += offloaded_optimizer if zero.offload_optimizer == "cpu" else 0
        nvme += offloaded_optimizer if zero.offload_optimizer == "nvme" else 0
    if zero.offload_param != "none":
        params -= offloaded_params
        host += offloaded_params if zero.offload_param == "cpu" else 0
        nvme += offloaded_params if zero.offload_param == "nvme" else 0
    return ModelStates(params=params, grads=grads, optimizer=optimizer, buffers=buffers, host=host, nvme=nvme)
