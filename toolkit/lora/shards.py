"""Which rows (or columns) of each PEFT tensor one tensor-parallel rank holds.

The base weight's split (toolkit.splits) is run on tensors that hold their own row numbers, so
the LoRA B of a column-parallel linear follows exactly the base's layout: per query group for
fused QKV, per TP rank [gate_r; up_r] for fused gate/up, a contiguous chunk otherwise. No second
copy of the interleave rules exists; a new split kind brings its LoRA layout with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from toolkit.splits.kinds import Geometry, SplitKind


class _IndexSource:
    """A split Source whose tensors hold global row numbers (axis 0) or column numbers (axis 1),
    numbered on across the HF tensors in order, so each number names one (tensor, row)."""

    def __init__(self, sizes: Sequence[tuple[str, int]], axis: int):
        self.axis = axis
        self.offsets, self.sizes, start = {}, {}, 0
        for name, size in sizes:
            self.offsets[name], self.sizes[name] = start, size
            start += size

    def shape(self, name: str) -> tuple[int, int]:
        return (self.sizes[name], 1) if self.axis == 0 else (1, self.sizes[name])

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        numbers = torch.arange(self.sizes[name], dtype=torch.int64) + self.offsets[name]
        numbers = numbers[:, None] if self.axis == 0 else numbers[None, :]
        return numbers[rows or slice(None), cols or slice(None)]


@dataclass(frozen=True)
class Placement:
    """Where one HF tensor's slice lies on one TP rank: `local[i]` is the position in the rank's
    megatron tensor (along the split axis) of HF row/column `hf[i]`."""

    local: torch.Tensor
    hf: torch.Tensor


def placements(split: SplitKind, sizes: Sequence[tuple[str, int]], tp: int, rank: int, geo: Geometry,
               axis: int) -> list[Placement]:
    """For each HF tensor (name, size along `axis`) of a row: its rows (axis 0) or columns
    (axis 1) on TP rank `rank`, as `split` places them."""
    source = _IndexSource(sizes, axis)
    numbers = split.build(source, [name for name, _ in sizes], tp, rank, geo).reshape(-1)
    found = []
    for name, size in sizes:
        start = source.offsets[name]
        local = torch.nonzero((numbers >= start) & (numbers < start + size)).reshape(-1)
        found.append(Placement(local, numbers[local] - start))
    return found
