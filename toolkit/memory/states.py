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

from dataclasses import dataclass, replace

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


def combined(dense: ModelStates, experts: ModelStates) -> ModelStates:
    """Two parameter groups of one engine (the dense weights over DP, the experts over the
    expert-DP group): their states add up; the buffers do not, as DeepSpeed reuses its reduce
    buckets for both and builds each group's fp32 gradient partition in step() one group at a time."""
    return ModelStates(params=dense.params + experts.params, grads=dense.grads + experts.grads,
                       optimizer=dense.optimizer + experts.optimizer, buffers=max(dense.buffers, experts.buffers),
                       host=dense.host + experts.host, nvme=dense.nvme + experts.nvme)


def frozen_states(numels, weight_bytes: int, dp: int, zero: ZeroSettings, adapter: ModelStates) -> ModelStates:
    """`adapter`'s states plus a frozen base of tensors `numels`: weights only, in the training
    dtype (DeepSpeed's optimizers take only parameters that require a gradient). ZeRO-3 partitions
    the base as any parameter and gathers it a module at a time."""
    w = weight_bytes
    if zero.stage < 3:
        return replace(adapter, params=adapter.params + w * sum(numels))
    part = sum(-(-n // dp) for n in numels)
    persistent = sum(n for n in numels if n < zero.param_persistence_threshold)
    gathered = min(max(numels, default=0) + zero.prefetch_bucket_size, zero.max_live_parameters)
    return replace(adapter, params=adapter.params + w * (part + persistent), buffers=adapter.buffers + w * gathered)


def _zero0(total: int, w: int) -> ModelStates:
    # fp32: torch AdamW straight on the model. bf16/fp16: DeepSpeed's FP16 optimizer wrapper
    # keeps an fp32 master copy and builds fp32 gradients for it during step().
    mixed = w < FP32_BYTES
    optimizer = (MASTER_BYTES * mixed + ADAM_STATE_BYTES) * total
    return ModelStates(params=w * total, grads=w * total, optimizer=optimizer,
                       buffers=FP32_BYTES * total * mixed)


def _zero12(numels, w: int, dp: int, zero: ZeroSettings, backward_calls: int) -> ModelStates:
    total, accumulating = sum(numels), backward_calls > 1
    part = -(-total // dp)
    overhang = boundary_overhang(numels, dp)
    buckets = w * zero.reduce_bucket_size * (2 if zero.overlap_comm else 1)
    optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * part
    # DeepSpeed builds the fp32 gradient partition the optimizer steps on (the "4 grads32" of
    # its own estimator) inside step(), and frees it after.
    step_grads = FP32_BYTES * part
    # ZeRO-1 leaves gradients in param.grad until the last backward of a step.
    full_grads = zero.stage == 1 and accumulating
    if zero.offload_optimizer == "none":
        grads = w * total if full_grads else w * (part + overhang)
        return ModelStates(params=w * total, grads=grads, optimizer=optimizer, buffers=buckets + step_grads)
    # ZeRO-Offload (stage_1_and_2.py): reduced gradients are copied to the host's fp32 gradient
    # partition through one staging buffer per side (largest tensor), updated weights come back
    # through a 16-bit copy of the partition, and ZeRO-2 accumulates the gradients of several
    # backward passes per step on the host, one buffer per tensor of the partition.
    staging = w * max(numels, default=0)  # a pipeline stage of dense layers only has no expert tensors
    host_accumulation = w * (part + overhang) if accumulating and not full_grads else 0
    host = optimizer + FP32_BYTES * part + w * part + staging + host_accumulation
    return _offloaded(ModelStates(params=w * total, grads=w * total if full_grads else 0, optimizer=0,
                                  buffers=buckets + staging), zero.offload_optimizer, host)


def boundary_overhang(numels, dp: int) -> int:
    """Extra gradient elements a ZeRO-1/2 rank holds: its gradient buffer keeps the whole of each
    tensor a partition boundary cuts (stage_1_and_2.py get_partition_info). A boundary falls in a
    tensor with probability proportional to its size, so on average a rank holds
    (dp - 1) / dp * sum(n^2) / sum(n) extra elements (none at DP 1)."""
    total = sum(numels)
    if dp == 1 or not total:
        return 0
    return int((dp - 1) / dp * sum(n * n for n in numels) / total)


def _zero3(numels, w: int, dp: int, zero: ZeroSettings) -> ModelStates:
    part = sum(-(-n // dp) for n in numels)
    persistent = sum(n for n in numels if n < zero.param_persistence_threshold)
    optimizer = (MASTER_BYTES + ADAM_STATE_BYTES) * part
    # The module being computed is gathered (and, in backward, its full gradient), plus what
    # the prefetcher has fetched ahead; never more than max_live_parameters.
    gathered = min(2 * max(numels, default=0) + zero.prefetch_bucket_size, zero.max_live_parameters)
    buffers = w * (zero.reduce_bucket_size + gathered)
    states = ModelStates(params=w * (part + persistent), grads=w * part, optimizer=optimizer, buffers=buffers)
    if zero.offload_optimizer == "none":
        # One sub-group at a time gets its fp32 gradient for the step (stage3.py _prepare_sub_group).
        states = replace(states, buffers=buffers + FP32_BYTES * min(part, zero.sub_group_size))
    else:
        # The host keeps an fp32 gradient buffer per sub-group for the whole run
        # (stage3.py initialize_optimizer_states); 16-bit gradients stay on the GPU.
        states = _offloaded(replace(states, optimizer=0), zero.offload_optimizer, optimizer + FP32_BYTES * part)
    if zero.offload_param != "none":
        states = _offloaded(replace(states, params=w * persistent), zero.offload_param, w * part)
    return states


def _offloaded(states: ModelStates, device: str, size: int) -> ModelStates:
    """Add `size` bytes moved off the GPU to host memory (cpu) or NVMe."""
    if device == "nvme":
        return replace(states, nvme=states.nvme + size)
    return replace(states, host=states.host + size)


def fsdp_states(numels, layer_numels, root_numels: int, weight_bytes: int, dp: int) -> ModelStates:
    """Bytes one rank holds under PyTorch FSDP2 (parallel.dp_engine=fsdp, toolkit.train.fsdp): the
    fp32 parameters are the master weights, sharded over DP (each tensor's rows padded to a
    multiple of DP), with the fp32 gradient shard and Adam's two moments: 4 + 4 + 8 bytes per
    parameter over DP, the 16 of ZeRO-3 in bf16 (2 + 2 + 12), 4 fewer in fp32 (no separate master).
    Gathered while computing: the root module (embedding, final norm, output layer; kept from its
    forward to its backward), the layer being computed and the one prefetched, in the compute
    dtype `weight_bytes`, plus one layer's fp32 gradient for the reduce-scatter."""
    part = sum(-(-n // dp) for n in numels)
    layer = max(layer_numels, default=0)
    gathered = weight_bytes * (root_numels + 2 * layer) + FP32_BYTES * layer
    return ModelStates(params=FP32_BYTES * part, grads=FP32_BYTES * part, optimizer=ADAM_STATE_BYTES * part,
                       buffers=gathered)
