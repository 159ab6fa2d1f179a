"""Layout-independent training state: fp32 master weights and Adam's moments as shards of global
tensors, so a run resumes at any TP x PP x DP and ZeRO stage.

    step_0000010/train/          megatron-core `torch_dist` (dist_checkpointing.save), keys:
      fp32.<key>                 fp32 master weight
      exp_avg.<key>              Adam first moment
      exp_avg_sq.<key>           Adam second moment
    where <key> and the sharding of each tensor are the ones megatron-core's own
    `model.sharded_state_dict()` gives the parameter: global (TP=1, all layers stacked) shapes,
    QKV per query group, fc1 as the global [gate; up] (its swiglu factory), the tied output layer
    stored once. These are the layouts the converter writes (toolkit.splits) and megatron-core
    loads, so every rank of any later layout reads just its own box of every tensor.

Why torch_dist and not DeepSpeed's universal checkpoint: the universal format is made by an
offline pass (ds_to_universal) that merges DeepSpeed's per-rank files, and it learns the TP
split of each tensor from Megatron-DeepSpeed's own names; ours would need that pass on every
requeue and a second description of fused QKV / [gate; up]. torch_dist reshards at load time,
without an offline step, from the same sharding metadata the model itself declares.

Why each parameter is written whole by one DP rank and not as ZeRO's flat fragments:
megatron-core 0.16.1 refuses ShardedTensor.flattened_range and its torch_dist strategy assumes
grid-aligned shards, while a ZeRO fragment may start in the middle of a row. So each parameter is
written whole by one rank of its DP group: at ZeRO-1/2 the one whose contiguous flat partition holds
its first element, and so (but for the few parameters straddling a partition boundary, whose parts
are summed over DP) the whole of it, read straight from the optimizer with no communication; at
ZeRO-3 parameter i, collected with DeepSpeed's safe_get_full_* API, by DP rank i % DP. No rank
writes more than about 1/DP of its stage's tensors, the same share ZeRO gives it. Loading reads each rank's TP/PP box and
hands DeepSpeed only this rank's fragment (safe_set_full_* at ZeRO-1/2, safe_set_local_* at 3).

Adam's step count is one number (every step updates every parameter) and goes, with the LR
schedule and the data position in samples, into train_state.json.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    from toolkit.convert.dist_format import IndexedReader

STATE_DIR = "train"
# (name in the checkpoint, DeepSpeed's optimizer-state key; None = the fp32 master weight)
STATES = (("fp32", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


class ElasticStateError(ToolkitError):
    """A layout-independent training state cannot be written or read."""


class ParamShards:
    """Each trainable parameter of this rank with megatron-core's sharding of it. Built before
    DeepSpeed wraps the model: ZeRO-3 empties the parameters, and the shards' shapes come from them."""

    def __init__(self, model):
        from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

        params = [p for p in model.parameters() if p.requires_grad]
        by_index = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
        missing = [i for i in range(len(params)) if i not in by_index]
        if missing:
            raise ElasticStateError(f"{len(missing)} parameters have no sharding in model.sharded_state_dict()")
        self.entries = [(params[i], by_index[i], tuple(params[i].shape)) for i in range(len(params))]

    @staticmethod
    def sharded(name: str, entry, data: torch.Tensor, replica_id=None):
        """`entry` (a ShardedTensor or a factory) for another tensor of the same shape."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        fields = {"key": f"{name}.{entry.key}", "data": data}
        if replica_id is not None:
            fields["replica_id"] = replica_id
        if isinstance(entry, ShardedTensor):
            fields["dtype"] = data.dtype
        return replace(entry, **fields)


def _main_over_dp(replica_id):
    """The replica id with its DP part set to 0: megatron-core's ids end with the DP rank
    (make_sharded_tensor_for_checkpoint: (0, tp_rank or 0, dp_rank)), or are the DP rank."""
    return (*replica_id[:-1], 0) if isinstance(replica_id, tuple) else 0


def save_state(directory: Path, engine, shards: ParamShards) -> None:
    """Collective: every rank calls it. Writes `directory` (which must not exist): each parameter's
    states by the one DP rank keeping it (zero_gather.kept_states), straight from the optimizer."""
    from toolkit.train import torch_dist_save, zero_gather

    _link_fragments(engine)
    params = [param for param, _, _ in shards.entries]
    sharded = {}
    for name, key in STATES:
        for index, full in zero_gather.kept_states(params, key):
            if full is None:
                raise ElasticStateError("DeepSpeed holds no fp32 state for a parameter (ZeRO-1/2/3 are supported)")
            entry = shards.entries[index][1]
            sharded[f"{name}/{index}"] = shards.sharded(name, entry, full.detach(), _main_over_dp(entry.replica_id))
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True)
    dist.barrier()
    torch_dist_save.save(sharded, str(directory))


def adam_step(engine) -> int:
    """Adam's step count: the same for every parameter group, or the state is not ours to carry."""
    state = _base_optimizer(engine).state
    steps = {int(state[flat]["step"]) for flat in _flat_partitions(engine) if "step" in state[flat]}
    if len(steps) > 1:
        raise ElasticStateError(f"Adam's step counts differ between parameter groups: {sorted(steps)}")
    return steps.pop() if steps else 0


def _base_optimizer(engine):
    zero = engine.optimizer
    return getattr(zero, "optimizer", zero)


def load_state(directory: Path, engine, shards: ParamShards, step: int, states=STATES) -> None:
    """Collective: read this rank's box of every tensor, give DeepSpeed this rank's fragment.
    One read per kind of state (master weights, then each moment), so a rank holds at most one
    fp32 copy of its TP/PP shard at a time. `states`: (key prefix in `directory`, DeepSpeed's key)
    pairs, ours by default (a Megatron-LM optimizer state: toolkit.train.megatron_optimizer)."""
    from toolkit.runtime import megatron_versions

    _create_adam_state(engine)
    for name, key in states:
        template = {
            str(index): shards.sharded(name, entry, torch.empty(shape, dtype=torch.float32))
            for index, (_, entry, shape) in enumerate(shards.entries)
        }
        loaded = megatron_versions.dist_load(template, directory)
        for index, (param, _, _) in enumerate(shards.entries):
            _set_fragment(param, loaded.pop(str(index)), key)
    for flat in _flat_partitions(engine):
        _base_optimizer(engine).state[flat]["step"].fill_(step)


def _create_adam_state(engine) -> None:
    """torch's AdamW creates its state at the first step, and DeepSpeed links each parameter's
    fragment of it only then: a fresh engine has nothing to load into. Create it as AdamW would
    (zeros, step 0) and let DeepSpeed link it."""
    base = _base_optimizer(engine)
    for flat in _flat_partitions(engine):
        state = base.state[flat]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat))
    _link_fragments(engine)


def _flat_partitions(engine) -> list[torch.Tensor]:
    """The fp32 flat partitions the base optimizer steps: one per group at ZeRO-1/2, one per
    sub-group at ZeRO-3 (whose optimizer param_groups hold only the sub-group stepped last)."""
    zero = engine.optimizer
    for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        if hasattr(zero, name):
            return list(getattr(zero, name))
    raise ElasticStateError(f"{type(zero).__name__} is not a ZeRO-1/2/3 optimizer")


def _link_fragments(engine) -> None:
    """ZeRO-1/2 link each parameter to its fragment of Adam's state after the first step of the
    *first* parameter group only (DeepSpeed 0.19.8, stage_1_and_2.py _optimizer_step), so the
    other groups' parameters have none: link again, now that every group has its state.
    (ZeRO-3 reads the optimizer state directly.)"""
    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _set_fragment(param, value: torch.Tensor, key) -> None:
    """Give DeepSpeed this rank's part of `value` (the whole TP/PP shard); a master weight also
    goes into the model's own (low-precision) copy, which DeepSpeed would refresh only after a step."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    device = param.device
    if hasattr(param, "ds_id"):  # ZeRO-3: a flat partition, the last one padded
        local = _zero3_partition(param, value.to(device))
        _set_zero3(param, local, key)
        return
    if key is None:
        safe_set_full_fp32_param(param, value.to(device))
        param.data.copy_(value.to(device, param.dtype))
    else:
        safe_set_full_optimizer_state(param, value.to(device), key)


def _zero3_partition(param, value: torch.Tensor) -> torch.Tensor:
    size = param.ds_tensor.numel()
    rank = dist.get_rank(group=param.ds_process_group)
    flat = value.flatten()
    padded = torch.zeros(size * dist.get_world_size(group=param.ds_process_group), dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded[rank * size : (rank + 1) * size]


def _set_zero3(param, local: torch.Tensor, key) -> None:
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    if key is None:
        safe_set_local_fp32_param(param, local)
        param.ds_tensor.data.copy_(local.to(param.ds_tensor.dtype))
    else:
        safe_set_local_optimizer_state(param, local, key)


def check_files(directory: Path) -> IndexedReader:
    """Before any process starts: the index and every byte range it points to are on disk, so a
    missing or truncated shard is one line, not a hang or a half-loaded model. Returns the checked
    directory's reader (toolkit.convert.dist_format.IndexedReader), its index read once."""
    from toolkit.convert.dist_format import IndexedReader

    directory = Path(directory)
    try:
        reader = IndexedReader(directory)
        storage = reader.read_metadata().storage_data
    except (OSError, ValueError, EOFError, RuntimeError) as e:
        raise ElasticStateError(f"{directory} has no readable torch_dist index ({type(e).__name__}): "
                                "incomplete checkpoint") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise ElasticStateError(f"{path} is missing: the checkpoint is incomplete")
        if path.stat().st_size < size:
            raise ElasticStateError(f"{path} is truncated ({path.stat().st_size} of at least {size} bytes)")
    return reader
