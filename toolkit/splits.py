"""How one megatron-core tensor is built from HF tensors and split across tensor-parallel ranks.

This is the one place that knows the layouts; both conversion directions and the tests use it.

    COLUMN      split dim 0 (ColumnParallelLinear output rows)
    ROW         split dim 1 (RowParallelLinear input columns)
    REPLICATED  every rank holds the whole tensor (norms)
    VOCAB       rows padded with zeros to the padded vocab, then split dim 0
    QKV         q, k, v fused per query group: [q heads of group g; k_g; v_g] for each g,
                then split dim 0 as a contiguous chunk. When TP > groups, a rank holds part of one
                group; megatron-core all-gathers and re-slices (attention.py, num_query_groups < TP).
    GATE_UP     [gate; up] fused, but per TP rank: rank r holds [gate_r; up_r], which is not a
                contiguous chunk of the TP=1 tensor.

A source is anything with `shape(name)` and `read(name, rows=slice|None, cols=slice|None)`, so a
rank's shard is read straight from the HF file without loading the whole tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:  # torch is imported where tensors are made, so the family tables stay cheap to import
    import torch


class Split(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    REPLICATED = "replicated"
    VOCAB = "vocab"
    QKV = "qkv"
    GATE_UP = "gate_up"


@dataclass(frozen=True)
class Geometry:
    """The sizes the splits need (from the model spec and the layout)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


class Source(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


def chunk_range(size: int, parts: int, index: int) -> slice:
    step = size // parts
    return slice(index * step, (index + 1) * step)


def build_shard(split: Split, src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    """The megatron tensor held by TP rank `rank` of `tp`, read from HF tensors `names`."""
    return _compact(_build_shard(split, src, names, tp, rank, geo))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: a slice view would make torch.save write the whole
    underlying buffer (a column slice keeps every full row alive)."""
    if not t.is_contiguous():
        return t.contiguous()  # a fresh, compact copy
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def _build_shard(split: Split, src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    import torch

    if split is Split.REPLICATED:
        return src.read(names[0])
    if split is Split.COLUMN:
        return src.read(names[0], rows=chunk_range(src.shape(names[0])[0], tp, rank))
    if split is Split.ROW:
        return src.read(names[0], cols=chunk_range(src.shape(names[0])[1], tp, rank))
    if split is Split.VOCAB:
        return _vocab_shard(src, names[0], tp, rank, geo)
    if split is Split.GATE_UP:
        gate, up = names
        rows = chunk_range(src.shape(gate)[0], tp, rank)
        return torch.cat([src.read(gate, rows=rows), src.read(up, rows=rows)], dim=0)
    if split is Split.QKV:
        return _qkv_shard(src, names, tp, rank, geo)
    raise AssertionError(split)


def merge_shards(split: Split, shards: Sequence[torch.Tensor], geo: Geometry) -> list[torch.Tensor]:
    """Inverse of build_shard: the HF tensors (in rule order) from all TP ranks' shards."""
    import torch

    if split is Split.REPLICATED:
        return [shards[0]]
    if split is Split.COLUMN:
        return [torch.cat(shards, dim=0)]
    if split is Split.ROW:
        return [torch.cat(shards, dim=1)]
    if split is Split.VOCAB:
        return [torch.cat(shards, dim=0)[: geo.vocab_size]]
    if split is Split.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if split is Split.QKV:
        return _split_qkv(torch.cat(shards, dim=0), geo)
    raise AssertionError(split)


def _vocab_shard(src: Source, name: str, tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    import torch

    rows = chunk_range(geo.padded_vocab_size, tp, rank)
    real_stop = max(rows.start, min(rows.stop, geo.vocab_size))
    real = src.read(name, rows=slice(rows.start, real_stop))  # may have no rows at all
    pad_rows = (rows.stop - rows.start) - real.shape[0]
    if pad_rows == 0:
        return real
    return torch.cat([real, torch.zeros(pad_rows, *real.shape[1:], dtype=real.dtype)])


def _qkv_shard(src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    q, k, v = names
    d, hpg = geo.head_dim, geo.heads_per_group
    block = (hpg + 2) * d  # rows of one query group in the fused tensor
    rows = chunk_range(geo.num_kv_heads * block, tp, rank)
    first, last = rows.start // block, -(-rows.stop // block)  # groups overlapping this rank
    fused = _interleave(
        src.read(q, rows=slice(first * hpg * d, last * hpg * d)),
        src.read(k, rows=slice(first * d, last * d)),
        src.read(v, rows=slice(first * d, last * d)),
        groups=last - first,
    )
    offset = first * block
    return fused[rows.start - offset : rows.stop - offset]


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    import torch

    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, geo: Geometry) -> list[torch.Tensor]:
    d, hpg, groups = geo.head_dim, geo.heads_per_group, geo.num_kv_heads
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def megatron_shape(split: Split, hf_shapes: Sequence[tuple[int, ...]], geo: Geometry, tp: int = 1) -> tuple[int, ...]:
    """Shape of one TP rank's megatron tensor (tp=1: the global tensor) from the HF shapes."""
    first = hf_shapes[0]
    if split is Split.REPLICATED:
        return first
    if split is Split.ROW:
        return (first[0], first[1] // tp)
    if split is Split.VOCAB:
        return (geo.padded_vocab_size // tp, *first[1:])
    rows = sum(s[0] for s in hf_shapes)  # COLUMN, QKV and GATE_UP stack their sources on dim 0
    return (rows // tp, *first[1:])
