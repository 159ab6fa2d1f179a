"""A per-rank checkpoint's tensors re-split for another TP x PP (x EP), one tensor at a time, each
shard copied piece by piece from the stored shards (memory-mapped) into one new tensor: memory
holds the shard being built and nothing else, never a merged global tensor (`ckpt reshard`'s bound).

Which ranges of the TP=1 tensor each shard holds, for the old TP size and the new, is the split
kind's rule (toolkit.splits.kinds `segments`); the stored stage and EP rank of a layer and an expert,
and the rank-local numbers they have there, follow from the old layout.
"""

from __future__ import annotations

import math
import mmap
from typing import Iterator

import torch

from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
from toolkit.convert.stages import on_stage, stage_megatron_shapes, stage_rows
from toolkit.families.table import Row
from toolkit.layouts import Layout
from toolkit.splits.kinds import Geometry, SplitKind


def reslice(split: SplitKind, shards: list[torch.Tensor], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    """The shard of TP rank `rank` of `tp` (at geometry `geo`) from `shards`, every stored TP rank's
    shard of the same tensor, copying only the ranges it holds; indices past the stored data (the
    vocabulary's padding, whose length depends on the layout) are zeros."""
    dim = split.dim
    whole = split.whole_size(shards[0].shape[dim], len(shards))
    size, data = split.resized(whole, geo)
    stored = _stored_pieces(split, shards, whole, geo)
    wanted = split.segments(size, tp, rank, geo)
    shape = list(shards[0].shape)
    shape[dim] = sum(s.stop - s.start for s in wanted)
    out = _own_mapping(shape, shards[0].dtype)
    at = 0
    for segment in wanted:
        for start, stop, shard, local in stored:
            first, last = max(start, segment.start), min(stop, segment.stop, data)
            if first < last:
                out.narrow(dim, at + first - segment.start, last - first).copy_(
                    shard.narrow(dim, local + first - start, last - first))
        padding = max(segment.start, data)
        if padding < segment.stop:
            out.narrow(dim, at + padding - segment.start, segment.stop - padding).zero_()
        at += segment.stop - segment.start
    return out


def _own_mapping(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in its own anonymous memory map, returned to the kernel as soon as the
    tensor is freed. torch.empty's memory comes from malloc, and glibc raises its mmap threshold to
    the largest block freed (up to 32 MiB): after one large shard, the next ones would come from the
    heap, which keeps up to twice that freed (measured: 35 MiB resident for shards of at most 8 MiB)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)  # the tensor keeps the map alive


def _stored_pieces(split: SplitKind, shards: list[torch.Tensor], size: int,
                   geo: Geometry) -> list[tuple[int, int, torch.Tensor, int]]:
    """(start, stop) in the TP=1 tensor, the shard holding it, and where in the shard it starts; a
    range held by several shards (a replicated tensor) is taken from the first."""
    pieces = []
    for rank, shard in enumerate(shards):
        local = 0
        for segment in split.segments(size, len(shards), rank, geo):
            pieces.append((segment.start, segment.stop, shard, local))
            local += segment.stop - segment.start
    pieces.sort(key=lambda piece: piece[0])
    kept, covered = [], 0
    for piece in pieces:
        if piece[0] >= covered:
            kept.append(piece)
            covered = piece[1]
    return kept


class Resharder:
    """The tensors of each rank of `layout` from a stored per-rank checkpoint `stored`, in rank-file
    order; the stored stages are memory-mapped (and checked) as first needed."""

    def __init__(self, stored: MegatronCheckpoint, layout: Layout):
        self.stored, self.layout, self.stages = stored, layout, {}
        self.geo = layout.geometry(stored.spec)

    def shapes(self, pp_rank: int) -> dict[str, tuple[int, ...]]:
        return stage_megatron_shapes(self.stored.family, self.stored.spec, self.layout, pp_rank)

    def rank_tensors(self, tp_rank: int, pp_rank: int, ep_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, row, layer, expert in stage_rows(self.stored.family, self.stored.spec, self.layout, pp_rank, ep_rank):
            yield name, reslice(row.split, self._shards(row, layer, expert), self.layout.tp, tp_rank, self.geo)

    def _shards(self, row: Row, layer: int | None, expert: int | None) -> list[torch.Tensor]:
        """Every stored TP rank's shard of `row` at (global) `layer` and `expert`."""
        old, spec = self.stored.layout, self.stored.spec
        if layer is None:  # the embedding on the first stage, the final norm and output layer on the last
            pp_rank, local = next(s for s in range(old.pp) if on_stage(row, s, old.pp)), None
        else:
            pp_rank, local = divmod(layer, spec.num_layers // old.pp)
        ep_rank, local_expert = (0, None) if expert is None else divmod(expert, spec.num_experts // old.ep)
        if (pp_rank, ep_rank) not in self.stages:
            self.stages[pp_rank, ep_rank] = self.stored.stage(pp_rank, ep_rank)
        name = row.megatron_name(local, local_expert)
        return [rank_state[name] for rank_state in self.stages[pp_rank, ep_rank]]
