"""The split kinds: how one megatron-core tensor is built from HF tensors and split across
tensor-parallel ranks, each kind one class holding its rules (toolkit/splits/__init__.py lists them).

A source is anything with `shape(name)` and `read(name, rows=slice|None, cols=slice|None)`, so a
rank's shard is read straight from the HF file without loading the whole tensor.

Each kind that can also says where a shard's bytes lie in the HF tensors (`row_pieces`: row
ranges, and a column range, of HF tensors stacked on dim 0), so the converter copies them file to
file without building the tensor (toolkit/convert/range_copy.py).

Each kind also says which ranges of the TP=1 megatron tensor a rank's shard holds (`segments`),
so a shard for one TP size is copied straight from the shards of another (toolkit.convert.reslice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:  # torch is imported where tensors are made, so the family tables stay cheap to import
    import torch


@dataclass(frozen=True)
class Geometry:
    """The sizes the splits need (from the model spec and the layout)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    # Qwen3-Next's gated delta net (linear attention): key heads, value heads, their head dims; 0 without
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    # Gemma 4's global layers: their KV heads and head size; 0 without
    global_kv_heads: int = 0
    global_head_dim: int = 0
    # Mamba-2 (Nemotron-H): heads, head dim, B/C groups, state size; 0 without
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class RowPiece:
    """Rows [start, stop) of HF tensor `name` (all columns, or `cols` of each row); a shard is its
    pieces stacked on dim 0. `name` None: rows of zeros (vocabulary padding)."""

    name: str | None
    start: int
    stop: int
    cols: slice | None = None


class Source(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


def chunk_range(size: int, parts: int, index: int) -> slice:
    step = size // parts
    return slice(index * step, (index + 1) * step)


class SplitKind:
    """One way a megatron tensor is made of HF tensors and spread over TP ranks."""

    name = ""
    dim = 0  # the dimension TP splits
    over_tp = True  # whether each TP rank holds a part (False: the whole tensor on every rank)

    def build(self, src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
        """The megatron tensor held by TP rank `rank` of `tp`, read from HF tensors `names`."""
        raise NotImplementedError

    def merge(self, shards: Sequence[torch.Tensor], geo: Geometry) -> list[torch.Tensor]:
        """Inverse of build: the HF tensors (in row order) from all TP ranks' shards."""
        raise NotImplementedError

    def shape(self, hf_shapes: Sequence[tuple[int, ...]], geo: Geometry, tp: int) -> tuple[int, ...]:
        """Shape of one TP rank's megatron tensor (tp=1: the global tensor) from the HF shapes."""
        raise NotImplementedError

    def row_pieces(self, src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> list[RowPiece] | None:
        """Where the bytes of `build`'s tensor lie in the HF tensors, or None where not described."""
        return None

    def segments(self, size: int, tp: int, rank: int, geo: Geometry | None = None) -> list[slice]:
        """The ranges along `dim` of the TP=1 megatron tensor (`size` long there) that rank `rank`
        of `tp` holds, in the order its shard stacks them (`geo`: for kinds whose parts depend on it)."""
        return [chunk_range(size, tp, rank)]

    def whole_size(self, shard_size: int, tp: int) -> int:
        """Length along `dim` of the TP=1 tensor whose shards over `tp` ranks are `shard_size` long."""
        return shard_size * tp

    def resized(self, size: int, geo: Geometry) -> tuple[int, int]:
        """(length along `dim` of the TP=1 tensor at geometry `geo`, how many of its first indices hold
        data) for a TP=1 tensor stored `size` long: the rest is zero padding."""
        return size, size

    def __repr__(self) -> str:
        return f"Split.{self.name}"


class Replicated(SplitKind):
    name = "REPLICATED"
    over_tp = False

    def build(self, src, names, tp, rank, geo):
        return src.read(names[0])

    def row_pieces(self, src, names, tp, rank, geo):
        return [RowPiece(names[0], 0, src.shape(names[0])[0])]

    def merge(self, shards, geo):
        return [shards[0]]

    def segments(self, size, tp, rank, geo=None):
        return [slice(0, size)]

    def whole_size(self, shard_size, tp):
        return shard_size

    def shape(self, hf_shapes, geo, tp):
        return hf_shapes[0]


class ColumnSplit(SplitKind):
    name = "COLUMN"

    def build(self, src, names, tp, rank, geo):
        return src.read(names[0], rows=chunk_range(src.shape(names[0])[0], tp, rank))

    def row_pieces(self, src, names, tp, rank, geo):
        rows = chunk_range(src.shape(names[0])[0], tp, rank)
        return [RowPiece(names[0], rows.start, rows.stop)]

    def merge(self, shards, geo):
        import torch

        return [torch.cat(shards, dim=0)]

    def shape(self, hf_shapes, geo, tp):
        """The sources stack on dim 0 (also for the fused kinds below), which TP splits."""
        rows = sum(s[0] for s in hf_shapes)
        return (rows // tp, *hf_shapes[0][1:])


class RelaidSplit(ColumnSplit):
    """A column-split tensor built by re-laying HF tensors out whole (each no bigger than the tensor):
    `to_megatron` / `to_hf` re-lay, `parts` lists what TP splits each on its own (the gated delta net's and
    Mamba-2's tensors, toolkit/splits/gated_delta.py and mamba.py)."""

    def to_megatron(self, tensors, geo: Geometry):
        raise NotImplementedError

    def to_hf(self, whole, geo: Geometry) -> list:
        raise NotImplementedError

    def parts(self, size: int, geo: Geometry) -> list[int]:
        """Lengths along dim 0 of the TP=1 tensor's parts that TP splits each on its own."""
        return [size]

    def _segments(self, size: int, tp: int, rank: int, geo: Geometry) -> list[slice]:
        out, start = [], 0
        for length in self.parts(size, geo):
            chunk = chunk_range(length, tp, rank)
            out.append(slice(start + chunk.start, start + chunk.stop))
            start += length
        return out

    def row_pieces(self, src, names, tp, rank, geo):
        """Not described: the shard's rows are re-laid from several HF tensors, not rows of the first
        (ColumnSplit's pieces would copy the wrong bytes, or too few: the record's size check refused
        Qwen3-Next's linear_qkv wherever its ranges were large enough to be copied)."""
        return None

    def build(self, src, names, tp, rank, geo):
        import torch

        whole = self.to_megatron([src.read(n) for n in names], geo)
        return torch.cat([whole[s] for s in self._segments(whole.shape[0], tp, rank, geo)])

    def merge(self, shards, geo):
        import torch

        tp, size = len(shards), sum(s.shape[0] for s in shards)
        pieces = [list(shard.split([s.stop - s.start for s in self._segments(size, tp, rank, geo)]))
                  for rank, shard in enumerate(shards)]
        # part by part, every rank's chunk of it in rank order
        return self.to_hf(torch.cat([p[i] for i in range(len(pieces[0])) for p in pieces]), geo)

    def segments(self, size, tp, rank, geo=None):
        if geo is None:
            raise ValueError(f"{self.name} tensors need the model's geometry to be resliced")
        return self._segments(size, tp, rank, geo)


class RowSplit(SplitKind):
    name = "ROW"
    dim = 1

    def build(self, src, names, tp, rank, geo):
        return src.read(names[0], cols=chunk_range(src.shape(names[0])[1], tp, rank))

    def row_pieces(self, src, names, tp, rank, geo):
        return [RowPiece(names[0], 0, src.shape(names[0])[0], chunk_range(src.shape(names[0])[1], tp, rank))]

    def merge(self, shards, geo):
        import torch

        return [torch.cat(shards, dim=1)]

    def shape(self, hf_shapes, geo, tp):
        first = hf_shapes[0]
        return (first[0], first[1] // tp)


class VocabSplit(SplitKind):
    name = "VOCAB"

    def _rows(self, tp: int, rank: int, geo: Geometry) -> tuple[slice, int]:
        """(this rank's rows of the padded table, where its real rows stop)."""
        rows = chunk_range(geo.padded_vocab_size, tp, rank)
        return rows, max(rows.start, min(rows.stop, geo.vocab_size))

    def build(self, src, names, tp, rank, geo):
        import torch

        rows, real_stop = self._rows(tp, rank, geo)
        real = src.read(names[0], rows=slice(rows.start, real_stop))  # may have no rows at all
        pad_rows = (rows.stop - rows.start) - real.shape[0]
        if pad_rows == 0:
            return real
        return torch.cat([real, torch.zeros(pad_rows, *real.shape[1:], dtype=real.dtype)])

    def row_pieces(self, src, names, tp, rank, geo):
        rows, real_stop = self._rows(tp, rank, geo)
        return [RowPiece(names[0], rows.start, real_stop), RowPiece(None, real_stop, rows.stop)]

    def merge(self, shards, geo):
        import torch

        return [torch.cat(shards, dim=0)[: geo.vocab_size]]

    def resized(self, size, geo):
        """The padded vocabulary depends on the layout (Layout.padded_vocab); padding rows are zeros."""
        return geo.padded_vocab_size, min(size, geo.vocab_size)

    def shape(self, hf_shapes, geo, tp):
        return (geo.padded_vocab_size // tp, *hf_shapes[0][1:])


class FusedGateUp(ColumnSplit):
    name = "GATE_UP"

    def _sources(self, src: Source, names: Sequence[str]) -> tuple[int, list[tuple[str, int]]]:
        """(ffn size, [(HF name, first row) of gate and of up])."""
        gate, up = names
        return src.shape(gate)[0], [(gate, 0), (up, 0)]

    def _to_hf(self, gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
        return [gate, up]

    def build(self, src, names, tp, rank, geo):
        import torch

        ffn, parts = self._sources(src, names)
        rows = chunk_range(ffn, tp, rank)
        return torch.cat([src.read(n, rows=slice(first + rows.start, first + rows.stop)) for n, first in parts], dim=0)

    def row_pieces(self, src, names, tp, rank, geo):
        ffn, parts = self._sources(src, names)
        rows = chunk_range(ffn, tp, rank)
        return [RowPiece(n, first + rows.start, first + rows.stop) for n, first in parts]

    def merge(self, shards, geo):
        import torch

        halves = [s.chunk(2, dim=0) for s in shards]
        return self._to_hf(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))

    def segments(self, size, tp, rank, geo=None):
        """The TP=1 tensor is [gate; up]; rank r holds [gate_r; up_r]."""
        ffn = size // 2
        rows = chunk_range(ffn, tp, rank)
        return [rows, slice(ffn + rows.start, ffn + rows.stop)]


class HFFusedGateUp(FusedGateUp):
    """HF holds [gate; up] in one tensor (Phi-3's gate_up_proj): re-split per TP rank."""

    name = "HF_GATE_UP"

    def _sources(self, src, names):
        ffn = src.shape(names[0])[0] // 2
        return ffn, [(names[0], 0), (names[0], ffn)]

    def _to_hf(self, gate, up):
        import torch

        return [torch.cat([gate, up])]


class FusedQKV(ColumnSplit):
    name = "QKV"

    def _sources(self, names: Sequence[str], geo: Geometry) -> list[tuple[str, int]]:
        """(HF name, first row) of q, of k and of v."""
        return [(n, 0) for n in names]

    def _to_hf(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return [q, k, v]

    def build(self, src, names, tp, rank, geo):
        (q, q0), (k, k0), (v, v0) = self._sources(names, geo)
        d, hpg = geo.head_dim, geo.heads_per_group
        block = (hpg + 2) * d  # rows of one query group in the fused tensor
        rows = chunk_range(geo.num_kv_heads * block, tp, rank)
        first, last = rows.start // block, -(-rows.stop // block)  # groups overlapping this rank
        fused = _interleave(
            src.read(q, rows=slice(q0 + first * hpg * d, q0 + last * hpg * d)),
            src.read(k, rows=slice(k0 + first * d, k0 + last * d)),
            src.read(v, rows=slice(v0 + first * d, v0 + last * d)),
            groups=last - first,
        )
        offset = first * block
        return fused[rows.start - offset : rows.stop - offset]

    def row_pieces(self, src, names, tp, rank, geo):
        """Per query group: its q rows, k rows, v rows; then this rank's rows of that sequence."""
        (q, q0), (k, k0), (v, v0) = self._sources(names, geo)
        d, hpg = geo.head_dim, geo.heads_per_group
        rows = chunk_range(geo.num_kv_heads * (hpg + 2) * d, tp, rank)
        fused = [piece for g in range(geo.num_kv_heads)
                 for piece in (RowPiece(q, q0 + g * hpg * d, q0 + (g + 1) * hpg * d),
                               RowPiece(k, k0 + g * d, k0 + (g + 1) * d), RowPiece(v, v0 + g * d, v0 + (g + 1) * d))]
        return _rows_of(fused, rows)

    def merge(self, shards, geo):
        import torch

        fused = torch.cat(shards, dim=0)
        d, hpg, groups = geo.head_dim, geo.heads_per_group, geo.num_kv_heads
        rest = fused.shape[1:]
        q, k, v = fused.reshape(groups, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
        return self._to_hf(*(t.reshape(-1, *rest).contiguous() for t in (q, k, v)))


class HFFusedQKV(FusedQKV):
    """HF holds [q; k; v] in one tensor (Phi-3's qkv_proj): re-fused per query group, as megatron-core wants."""

    name = "HF_QKV"

    def _sources(self, names, geo):
        q_rows, kv_rows = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
        return [(names[0], 0), (names[0], q_rows), (names[0], q_rows + kv_rows)]

    def _to_hf(self, q, k, v):
        import torch

        return [torch.cat([q, k, v])]


def _rows_of(pieces: list[RowPiece], rows: slice) -> list[RowPiece]:
    """Rows [rows.start, rows.stop) of the tensor the pieces stack into, as pieces."""
    out, at = [], 0
    for p in pieces:
        size = p.stop - p.start
        lo, hi = max(rows.start - at, 0), min(rows.stop - at, size)
        if lo < hi:
            out.append(RowPiece(p.name, p.start + lo, p.start + hi, p.cols))
        at += size
    return out


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    import torch

    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


class FusedQK(FusedQKV):
    """Keys that are also the values (Gemma 4's attention_k_eq_v): q and k fused per query group,
    [q heads of group g; k_g] for each g, then split dim 0 as a contiguous chunk. The layer reuses
    each group's k as its v (toolkit/blocks/linears.py KeyIsValueLinear)."""

    name = "QK"

    def _sources(self, names, geo):
        return [(n, 0) for n in names]

    def _to_hf(self, q, k):
        return [q, k]

    def build(self, src, names, tp, rank, geo):
        import torch

        (q, q0), (k, k0) = self._sources(names, geo)
        d, hpg, groups = geo.head_dim, geo.heads_per_group, geo.num_kv_heads
        rows = chunk_range(groups * (hpg + 1) * d, tp, rank)
        qs, ks = src.read(q, rows=slice(q0, q0 + groups * hpg * d)), src.read(k, rows=slice(k0, k0 + groups * d))
        rest = qs.shape[1:]
        fused = torch.cat([qs.reshape(groups, -1, *rest), ks.reshape(groups, -1, *rest)], dim=1).reshape(-1, *rest)
        return fused[rows]

    def row_pieces(self, src, names, tp, rank, geo):
        (q, q0), (k, k0) = self._sources(names, geo)
        d, hpg = geo.head_dim, geo.heads_per_group
        rows = chunk_range(geo.num_kv_heads * (hpg + 1) * d, tp, rank)
        fused = [piece for g in range(geo.num_kv_heads)
                 for piece in (RowPiece(q, q0 + g * hpg * d, q0 + (g + 1) * hpg * d), RowPiece(k, k0 + g * d, k0 + (g + 1) * d))]
        return _rows_of(fused, rows)

    def merge(self, shards, geo):
        import torch

        fused = torch.cat(shards, dim=0)
        d, hpg, groups = geo.head_dim, geo.heads_per_group, geo.num_kv_heads
        rest = fused.shape[1:]
        q, k = fused.reshape(groups, (hpg + 1) * d, *rest).split([hpg * d, d], dim=1)
        return self._to_hf(*(t.reshape(-1, *rest).contiguous() for t in (q, k)))


class GlobalLayer(SplitKind):
    """`inner` on a Gemma 4 global layer: its head size and KV heads (Geometry.global_*) in place of the model's."""

    def __init__(self, inner: SplitKind):
        self.inner, self.name, self.dim = inner, f"GLOBAL_{inner.name}", inner.dim
        self.over_tp = getattr(inner, "over_tp", True)

    @staticmethod
    def _geo(geo: Geometry) -> Geometry:
        from dataclasses import replace

        return replace(geo, num_kv_heads=geo.global_kv_heads, head_dim=geo.global_head_dim)

    def build(self, src, names, tp, rank, geo):
        return self.inner.build(src, names, tp, rank, self._geo(geo))

    def row_pieces(self, src, names, tp, rank, geo):
        return self.inner.row_pieces(src, names, tp, rank, self._geo(geo))

    def merge(self, shards, geo):
        return self.inner.merge(shards, self._geo(geo))

    def shape(self, hf_shapes, geo, tp):
        return self.inner.shape(hf_shapes, self._geo(geo), tp)

    def segments(self, size, tp, rank, geo=None):
        return self.inner.segments(size, tp, rank, None if geo is None else self._geo(geo))

    def whole_size(self, shard_size, tp):
        return self.inner.whole_size(shard_size, tp)

    def resized(self, size, geo):
        return self.inner.resized(size, self._geo(geo))


class Unsplit(SplitKind):
    """`inner`'s tensor whole on every TP rank: the experts of a model whose MoE layers have biases,
    which megatron-core runs only at expert tensor parallelism 1 (transformer_config.py:1588)."""

    over_tp = False

    def __init__(self, inner: SplitKind):
        self.inner, self.name, self.dim = inner, f"UNSPLIT_{inner.name}", inner.dim

    def build(self, src, names, tp, rank, geo):
        return self.inner.build(src, names, 1, 0, geo)

    def row_pieces(self, src, names, tp, rank, geo):
        return self.inner.row_pieces(src, names, 1, 0, geo)

    def merge(self, shards, geo):
        return self.inner.merge(shards[:1], geo)

    def shape(self, hf_shapes, geo, tp):
        return self.inner.shape(hf_shapes, geo, 1)

    def segments(self, size, tp, rank, geo=None):
        return [slice(0, size)]

    def whole_size(self, shard_size, tp):
        return shard_size

    def resized(self, size, geo):
        return self.inner.resized(size, geo)


def build_shard(split: SplitKind, src: Source, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    """The megatron tensor held by TP rank `rank` of `tp`, as a tensor owning exactly its bytes."""
    return _compact(split.build(src, names, tp, rank, geo))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: a slice view would make torch.save write the whole
    underlying buffer (a column slice keeps every full row alive)."""
    if not t.is_contiguous():
        return t.contiguous()  # a fresh, compact copy
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def merge_shards(split: SplitKind, shards: Sequence[torch.Tensor], geo: Geometry) -> list[torch.Tensor]:
    return split.merge(shards, geo)


def megatron_shape(split: SplitKind, hf_shapes: Sequence[tuple[int, ...]], geo: Geometry, tp: int = 1) -> tuple[int, ...]:
    return split.shape(hf_shapes, geo, tp)
