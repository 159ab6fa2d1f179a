"""Cross-checks between a megatron checkpoint's metadata, its HF config and its shards.

An edited toolkit_checkpoint.json (half the layers, another hidden size, another layout) or a
shard set from another model must be refused, not exported as a model that silently differs
from what its config says. Every check here runs before the tensor it guards is used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.convert.stages import row_instances, stage_megatron_shapes
from toolkit.errors import ConversionError
from toolkit.families import Family, ModelSpec
from toolkit.layouts import Layout
from toolkit.splits.kinds import megatron_shape

EDITED_HINT = "the checkpoint was edited or mixed with another one; convert again from the HF model"


def expected_hf_tensors(family: Family, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the family table expects for this config, with its shape."""
    out = {}
    for row in family.rows_for(spec):
        for layer, _, expert, _ in row_instances(row, range(spec.num_layers), range(spec.num_experts), spec.moe_layers, spec.linear_layers):
            for name, symbols in zip(row.hf_names(layer, expert), row.shapes):
                out[name] = tuple(spec.size_of(s) for s in symbols)
    return out


def check_spec_matches_config(meta_spec: ModelSpec, config_spec: ModelSpec, meta_path: Path, config_path: Path) -> None:
    for f in dataclasses.fields(ModelSpec):
        recorded, implied = getattr(meta_spec, f.name), getattr(config_spec, f.name)
        if recorded != implied:
            raise ConversionError(f"{meta_path} says {f.name}={recorded!r} but {config_path} implies "
                                  f"{implied!r}: {EDITED_HINT}")


def check_format_files(fmt: str, shards: Path) -> None:
    """The files are of the format the metadata names (a torch_dist checkpoint has DCP's .metadata)."""
    from toolkit.convert import dist_format  # here: torch.distributed.checkpoint is ~0.7 s of start-up

    is_dist = (shards / dist_format.DCP_METADATA).is_file()
    if is_dist != (fmt == "torch_dist"):
        found = "torch_dist" if is_dist else "torch"
        raise ConversionError(f"{shards} holds a {found} checkpoint but the metadata says format {fmt!r}: {EDITED_HINT}")


def check_rank_layout(found: tuple[int, int, int], layout: Layout, shards: Path) -> None:
    if found != (layout.tp, layout.pp, layout.ep):
        raise ConversionError(f"{shards} holds rank files for TP={found[0]} PP={found[1]} EP={found[2]} but the "
                              f"metadata says TP={layout.tp} PP={layout.pp} EP={layout.ep}: {EDITED_HINT}")


def _compare(found: dict[str, tuple], expected: dict[str, tuple], where: str) -> None:
    unexpected, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    wrong = sorted(n for n in set(found) & set(expected) if tuple(found[n]) != tuple(expected[n]))
    if unexpected or missing or wrong:
        example = (f"unexpected {unexpected[0]!r}" if unexpected else f"missing {missing[0]!r}" if missing
                   else f"{wrong[0]!r} is {list(found[wrong[0]])}, expected {list(expected[wrong[0]])}")
        raise ConversionError(f"the tensors in {where} do not match the metadata "
                              f"({len(unexpected)} unexpected, {len(missing)} missing, {len(wrong)} misshapen; "
                              f"e.g. {example}): {EDITED_HINT}")


def check_stage(stage: list[dict], family: Family, spec: ModelSpec, layout: Layout, pp_rank: int, where: Path) -> None:
    """Every TP rank file of a stage holds exactly the tensors (and shapes) the metadata implies."""
    expected = stage_megatron_shapes(family, spec, layout, pp_rank)
    for tp_rank, state in enumerate(stage):
        _compare({k: tuple(v.shape) for k, v in state.items()}, expected, f"{where} (TP rank {tp_rank}, stage {pp_rank})")


def expected_dist_shapes(family: Family, spec: ModelSpec, layout: Layout) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor a torch_dist checkpoint of this model holds."""
    from toolkit.convert import dist_format

    geo, hf = layout.geometry(spec), expected_hf_tensors(family, spec)
    stacked = dist_format.stacks_layers(spec.moe_layers, spec.linear_layers)
    out = {}
    for row in family.rows_for(spec):
        for layer, _, expert, _ in row_instances(row, range(spec.num_layers), range(1), spec.moe_layers, spec.linear_layers):
            whole = megatron_shape(row.split, [hf[n] for n in row.hf_names(layer, expert)], geo)
            for suffix, _, rows in dist_format.dist_parts(row.split, whole, geo):
                shape = (spec.num_experts, rows, *whole[1:]) if row.per_expert else (rows, *whole[1:])
                if row.per_layer and stacked:
                    out[dist_format.row_key(row, 0, stacked) + suffix] = (spec.num_layers, *shape)
                else:
                    out[dist_format.row_key(row, layer, stacked) + suffix] = shape
    if spec.is_moe:
        out.update((alias, out[key]) for key in list(out) if (alias := dist_format.te_moe_alias(key, spec.moe_layers)))
    return out


def check_dist(stored: dict[str, tuple], family: Family, spec: ModelSpec, layout: Layout, where: Path) -> None:
    _compare({k: shape for k, (shape, _) in stored.items()}, expected_dist_shapes(family, spec, layout), str(where))
