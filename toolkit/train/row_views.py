"""Rows over prepared samples: the same rows toolkit.train.data and toolkit.train.preference build
in memory, made when indexed, from memory-mapped arrays (toolkit.train.prepared_store).

Row i is made from its samples' tokens by the same functions (padded_row, packed_row, pack_plan),
so a batch is the same, bit for bit, whichever way the data was read. What a view keeps in memory
is per sample or per row (a length, an index, counts), never per token: a rank reads the tokens of
the rows it is handed, and `counts` gives a global batch's loss normaliser from the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolkit.train.data import GlobalCounts, Row, Sample, pack_plan, packed_row, padded_row


class PairItems(Sequence):
    """A prepared method=dpo store as (chosen, rejected) samples: sequences 2i and 2i + 1."""

    def __init__(self, store):
        self.store = store

    def __len__(self) -> int:
        return len(self.store) // 2

    def __getitem__(self, i: int) -> tuple[Sample, Sample]:
        return self.store[2 * i], self.store[2 * i + 1]

    @property
    def lengths(self) -> np.ndarray:
        return self.store.lengths.reshape(-1, 2)

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.store.targets).reshape(-1, 2)


class MixedItems(Sequence):
    """Samples (or pairs) of several stores as toolkit.train.data.mixture_picks picked them."""

    def __init__(self, parts: list, picks: list[list[int]]):
        self.parts = parts
        self.part = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, p in enumerate(picks)])
        self.index = np.concatenate([np.asarray(p, dtype=np.int64) for p in picks])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        return self.parts[self.part[i]][int(self.index[i])]

    def _gathered(self, name: str) -> np.ndarray:
        arrays = [np.asarray(getattr(part, name)) for part in self.parts]
        out = np.empty((len(self), *arrays[0].shape[1:]), dtype=np.int64)
        for i, array in enumerate(arrays):
            taken = self.part == i
            out[taken] = array[self.index[taken]]
        return out

    @property
    def lengths(self) -> np.ndarray:
        return self._gathered("lengths")

    @property
    def targets(self) -> np.ndarray:
        return self._gathered("targets")


class RowView(Sequence):
    """Rows made on indexing; `row_targets` and `row_real` (per row) give GlobalCounts."""

    row_targets: np.ndarray
    row_real: np.ndarray

    def counts(self, indices: list[int]) -> GlobalCounts:
        idx = np.asarray(indices, dtype=np.int64)
        return GlobalCounts(int(self.row_targets[idx].sum()), int(self.row_real[idx].sum()))


class PaddedRows(RowView):
    """One sample a row (toolkit.train.data.pad_rows)."""

    def __init__(self, items, length: int, pad_id: int):
        self.items, self.length, self.pad_id = items, length, pad_id
        # As GlobalCounts.of: targets are loss_mask[1:], real inputs the first length - 1 tokens.
        self.row_targets = np.asarray(items.targets, dtype=np.int64)
        self.row_real = np.minimum(items.lengths, length - 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Row:
        return padded_row(self.items[i], self.length, self.pad_id)


class PackedRows(RowView):
    """Samples packed greedily in order (toolkit.train.data.pack_rows), planned from their lengths."""

    def __init__(self, items, length: int, pad_id: int):
        self.items, self.length, self.pad_id = items, length, pad_id
        lengths = np.asarray(items.lengths, dtype=np.int64)
        self.starts = np.asarray(pack_plan(lengths.tolist(), length), dtype=np.int64)
        bounds = self.starts[:-1]
        # A packed document's first token is never a target, which its own targets already leave out.
        self.row_targets = np.add.reduceat(np.asarray(items.targets, dtype=np.int64), bounds) if len(bounds) else bounds
        self.row_real = np.minimum(np.add.reduceat(lengths, bounds), length - 1) if len(bounds) else bounds

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> Row:
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return packed_row([self.items[j] for j in range(a, b)], self.length, self.pad_id)


class PairRows(RowView):
    """Pairs of padded rows (toolkit.train.preference.to_pair_rows); a pair counts once in the loss
    normaliser (PairSource's)."""

    def __init__(self, items, length: int, pad_id: int):
        self.items, self.length, self.pad_id = items, length, pad_id
        self.row_targets = np.ones(len(items), dtype=np.int64)
        self.row_real = np.minimum(items.lengths, length - 1).sum(axis=1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from toolkit.train.preference import PairRow

        chosen, rejected = self.items[i]
        return PairRow(padded_row(chosen, self.length, self.pad_id), padded_row(rejected, self.length, self.pad_id))


def row_view(items, length: int, pad_id: int, method: str, pack: bool) -> RowView:
    if method == "dpo":
        return PairRows(items, length, pad_id)
    return PackedRows(items, length, pad_id) if pack else PaddedRows(items, length, pad_id)
