"""Whole (TP/PP-shard) fp32 tensors of parameters whose master weights and Adam moments ZeRO holds
in fragments across the DP group: the fragments of many parameters summed in one all-reduce
(`full_states`, every parameter on every rank), or each parameter on one DP rank (`kept_states`,
what a checkpoint writes, with almost no communication).

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


def kept_states(params: list, key: str | None) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(index, whole state) of the parameters this DP rank keeps in a checkpoint, so that each is
    kept by exactly one rank of its DP group (about 1/DP of the states each). At ZeRO-1/2: the rank
    whose flat partition holds the parameter's first element. The partitions are contiguous, so that
    rank holds the whole parameter, except for the few that straddle a partition boundary (at most one
    per boundary and group), whose parts are summed over DP. None, on every rank, for a parameter
    without ZeRO's fragment mapping. At ZeRO-3: parameter i on DP rank i % DP, each collected whole.
    A yielded tensor may view the optimizer's own state: write it, do not change it."""
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3
        for index, full in _one_by_one(params, key):
            group = params[index].ds_process_group
            if index % dist.get_world_size(group=group) == dist.get_rank(group=group):
                yield index, full
        return
    straddling = _straddling(params)
    summed = {}
    for bucket in _buckets([params[i] for i in straddling]):
        for position, full in _reduce([params[i] for i in straddling], bucket, key):
            summed[straddling[position]] = full
    for index, param in enumerate(params):
        mapping = getattr(param, "_hp_mapping", False)
        if mapping is False:
            yield index, None
        elif mapping is not None and mapping.lp_fragment_address.start == 0:
            yield index, summed[index] if index in summed else mapping.get_hp_fragment(key).view(param.shape)


def _straddling(params: list) -> list[int]:
    """Indices of the parameters split between two or more ranks' partitions: a rank knows only of
    its own part, so every DP group (dense, expert) agrees on them in one small all-reduce."""
    groups = {}
    for param in params:
        if hasattr(param, "_hp_mapping"):
            groups.setdefault(param._dp_group, param.device)  # the same order on every rank of a group
    split = [0] * len(params)
    for group, device in groups.items():
        mine = torch.tensor([int(getattr(p, "_dp_group", None) is group and p._hp_mapping is not None
                                 and p._hp_mapping.lp_fragment_address.numel < p.numel()) for p in params],
                            dtype=torch.int32, device=device)
        dist.all_reduce(mine, group=group)
        split = [a + b for a, b in zip(split, mine.tolist())]
    return [index for index in range(len(params)) if split[index] > 0]


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
