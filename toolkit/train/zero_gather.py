"""Whole (TP/PP-shard) fp32 tensors of parameters whose master weights and Adam moments ZeRO holds
in fragments across the DP group: the fragments of many parameters summed in one all-reduce.

DeepSpeed's safe_get_full_fp32_param / safe_get_full_optimizer_state do the same one parameter at a
time (utils/tensor_fragment.py get_full_hp_param: zeros, this rank's fragment copied in, all-reduce
over the DP group); a checkpoint calling them for every parameter and state makes three collectives
per parameter, the largest part of the train/ state's cost (benchmarks/save_bench.py). ZeRO-3
partitions parameters its own way and keeps DeepSpeed's per-parameter path.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

# fp32 bytes summed per all-reduce: few collectives, and a bounded extra buffer on every rank.
BUCKET_BYTES = 64 * 2**20
FP32_BYTES = 4


def full_states(params: list, key: str | None) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(index in `params`, the whole fp32 master (key None) or optimizer state `key`) for every
    parameter, in order; None for one DeepSpeed holds no fp32 state of (a frozen one). Collective:
    every DP rank calls it with the same parameters. A yielded tensor may view a shared buffer:
    clone what is kept."""
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3
        yield from _one_by_one(params, key)
        return
    for bucket in _buckets(params):
        yield from _reduce(params, bucket, key)


def _one_by_one(params, key):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    for index, param in enumerate(params):
        yield index, safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)


def _buckets(params) -> Iterator[list[int]]:
    """Runs of parameter indices with the same DP group, up to BUCKET_BYTES each (a larger
    parameter alone); a parameter without ZeRO's fragment mapping alone."""
    bucket, size, group = [], 0, None
    for index, param in enumerate(params):
        mapped = hasattr(param, "_hp_mapping")
        nbytes = param.numel() * FP32_BYTES
        if bucket and (not mapped or param._dp_group is not group or size + nbytes > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        if not mapped:
            yield [index]
            continue
        bucket.append(index)
        size, group = size + nbytes, param._dp_group
    if bucket:
        yield bucket


def _reduce(params, bucket: list[int], key):
    first = params[bucket[0]]
    if not hasattr(first, "_hp_mapping"):
        yield bucket[0], None
        return
    offsets, total = [], 0
    for index in bucket:
        offsets.append(total)
        total += params[index].numel()
    flat = torch.zeros(total, dtype=torch.float32, device=first.device)
    for index, offset in zip(bucket, offsets):
        mapping = params[index]._hp_mapping
        if mapping is not None:  # this rank holds a fragment of it
            address = mapping.lp_fragment_address
            flat.narrow(0, offset + address.start, address.numel).copy_(mapping.get_hp_fragment(key).data)
    dist.all_reduce(flat, group=first._dp_group)
    for index, offset in zip(bucket, offsets):
        param = params[index]
        yield index, flat.narrow(0, offset, param.numel()).view(param.shape)
