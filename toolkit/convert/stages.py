"""What one (TP rank, PP stage, EP rank) of a megatron-core model holds, built from HF tensors.

Used by the converter (writing per-rank files) and by the trainer (loading a per-rank checkpoint
into another layout)."""

from __future__ import annotations

from typing import Iterator

import torch

from toolkit.families import Family, ModelSpec
from toolkit.families.table import Row
from toolkit.layouts import Layout
from toolkit.splits.kinds import build_shard, megatron_shape


def on_stage(row: Row, stage: int, pp: int) -> bool:
    """Layers are split over stages; the embedding is on the first, final norm and output on the last."""
    if row.per_layer:
        return True
    return stage == 0 if row.megatron.startswith("embedding.") else stage == pp - 1


def embedding_row(family: Family) -> Row:
    return next(r for r in family.rows if r.megatron.startswith("embedding."))


def _ties_output_here(spec: ModelSpec, layout: Layout, pp_rank: int) -> bool:
    # Megatron keeps a copy of the tied embedding as the last stage's output layer.
    return spec.tied_embeddings and layout.pp > 1 and pp_rank == layout.pp - 1


def row_instances(row: Row, layers: range, experts: range, moe_layers: str | None = None,
                  linear_layers: str | None = None) -> Iterator[tuple[int | None, int | None, int | None, int | None]]:
    """(global layer, stage-local layer, global expert, rank-local expert) of each tensor of `row`
    on a stage holding `layers` and an EP rank holding `experts` (None where the row has no such
    index); only the layers of the row's kinds (`moe_layers`, `linear_layers` as ModelSpec's)."""
    for layer in [n for n in layers if row.on_layer(n, moe_layers, linear_layers)] if row.per_layer else [None]:
        local = None if layer is None else layer - layers.start
        if row.per_expert:
            for i, expert in enumerate(experts):
                yield layer, local, expert, i
        else:
            yield layer, local, None, None


def stage_hf_names(family: Family, spec: ModelSpec, layout: Layout, pp_rank: int, ep_rank: int = 0) -> set[str]:
    layers, experts = layout.stage_layers(spec, pp_rank), layout.local_experts(spec, ep_rank)
    names = {
        name
        for row in family.rows_for(spec)
        if on_stage(row, pp_rank, layout.pp)
        for layer, _, expert, _ in row_instances(row, layers, experts, spec.moe_layers, spec.linear_layers)
        for name in row.hf_names(layer, expert)
    }
    if _ties_output_here(spec, layout, pp_rank):
        names |= set(embedding_row(family).hf_names())
    return names


def stage_rows(family: Family, spec: ModelSpec, layout: Layout, pp_rank: int,
               ep_rank: int = 0) -> Iterator[tuple[str, Row, int | None, int | None]]:
    """(canonical name with stage-local layer and rank-local expert numbers, its row, global layer,
    global expert) of every tensor one rank of the stage holds, in rank-file order; a tied output
    layer (the last stage's copy of the embedding) is the embedding's row."""
    layers, experts = layout.stage_layers(spec, pp_rank), layout.local_experts(spec, ep_rank)
    for row in family.rows_for(spec):
        if on_stage(row, pp_rank, layout.pp):
            for layer, local, expert, local_expert in row_instances(row, layers, experts, spec.moe_layers, spec.linear_layers):
                yield row.megatron_name(local, local_expert), row, layer, expert
    if _ties_output_here(spec, layout, pp_rank):
        yield "output_layer.weight", embedding_row(family), None, None


def stage_megatron_shapes(family: Family, spec: ModelSpec, layout: Layout, pp_rank: int) -> dict[str, tuple[int, ...]]:
    """(canonical name with stage-local layer number) -> shape of one TP rank's shard, for the
    tensors stage_tensors yields: what a rank file of this stage must hold."""
    geo = layout.geometry(spec)
    return {name: megatron_shape(row.split, [tuple(spec.size_of(s) for s in symbols) for symbols in row.shapes], geo,
                                 layout.tp)
            for name, row, _, _ in stage_rows(family, spec, layout, pp_rank)}


def stage_tensors(src, family: Family, spec: ModelSpec, layout: Layout, tp_rank: int, pp_rank: int,
                  on_tensor=lambda: None, ep_rank: int = 0, build=build_shard) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name with stage-local layer and rank-local expert numbers, this rank's shard) for
    every tensor of the stage; experts split over TP as dense tensors are (expert TP = TP).
    `build` has build_shard's signature (the converter's yields byte ranges where it can)."""
    geo = layout.geometry(spec)
    for name, row, layer, expert in stage_rows(family, spec, layout, pp_rank, ep_rank):
        yield name, build(row.split, src, row.hf_names(layer, expert), layout.tp, tp_rank, geo)
        on_tensor()


class TensorSource:
    """A Source (see toolkit.splits.kinds) over tensors already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        if rows is not None:
            t = t[rows]
        return t if cols is None else t[:, cols]
