"""LoRA applied to this rank's megatron-core model, and gathered back into whole PEFT tensors.

Every LoRA tensor is a slice of a whole PEFT tensor (`Piece`): replicated ones hold all of it,
split ones the rows or columns toolkit.lora.shards places on this TP rank. The same pieces split
an imported adapter onto the layout and gather the trained one back, so a round trip is exact.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass, field

import torch

from toolkit.families import Family, ModelSpec
from toolkit.layouts import Layout
from toolkit.lora import experts, peft_dir, peft_rewrites, targets
from toolkit.lora.layers import ColumnParallelLora, RowParallelLora
from toolkit.lora.peft_dir import LoraSettings, peft_key
from toolkit.lora.shards import placements
from toolkit.errors import AdapterError


@dataclass
class Piece:
    """This rank's slice of one whole PEFT tensor: `index` along `axis` (in local order)."""

    key: str
    shape: tuple[int, int]
    axis: int
    index: torch.Tensor
    param: torch.nn.Parameter | None = None
    expert: bool = False  # a routed expert's: held by one EP rank, replicated over its expert-DP group
    transposed: bool = False  # the parameter holds the slice transposed (Llama 4's experts: ExpertTarget.swapped)

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        piece = whole.index_select(self.axis, self.index)
        return (piece.T if self.transposed else piece).contiguous().clone()


@dataclass
class Adapter:
    """What apply_lora did on this rank: the settings and every LoRA tensor's piece."""

    settings: LoraSettings
    base: dict  # peft_dir.base_reference of the base checkpoint
    base_name: str | None = None  # base_model_name_or_path for adapter_config.json
    pieces: list[Piece] = field(default_factory=list)

    def local_pieces(self) -> list[tuple[str, tuple, int, torch.Tensor, torch.Tensor]]:
        """(key, shape, axis, index, fp32 values) of each piece: ZeRO's master copy where it
        partitions the parameter (a collective over DP: every rank calls this)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = []
        for piece in self.pieces:
            full = safe_get_full_fp32_param(piece.param)
            values = (piece.param.detach() if full is None else full).float().cpu()
            values = (values.T if piece.transposed else values).contiguous().clone()
            out.append((piece.key, piece.shape, piece.axis, piece.index, values))
        return out


def save_adapter(adapter: Adapter, out) -> None:
    """Collective: every rank's pieces (one DP replica's) to rank 0, which writes the PEFT directory.
    Under expert parallelism DP rank 0 holds one EP rank's experts only: an expert's pieces come
    from expert-DP rank 0 of each EP rank instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    replica = {False: ps.get_data_parallel_rank() == 0, True: ps.get_expert_data_parallel_rank() == 0}
    local = [values for piece, values in zip(adapter.pieces, adapter.local_pieces()) if replica[piece.expert]]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        whole = assemble(piece for pieces in gathered for piece in pieces)
        peft_dir.write(out, whole, adapter.settings, adapter.base, adapter.base_name)


def assemble(pieces) -> dict[str, torch.Tensor]:
    """Whole PEFT tensors from every rank's pieces (replicas write the same values)."""
    whole: dict[str, torch.Tensor] = {}
    for key, shape, axis, index, values in pieces:
        target = whole.setdefault(key, torch.zeros(shape, dtype=values.dtype))
        target.index_copy_(axis, index, values)
    return whole


def peft_init(key: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's initialisation (LoraLayer.reset_lora_parameters): A Kaiming-uniform with a=sqrt(5),
    B zero; drawn whole from a generator seeded by the key, so every rank and layout agrees."""
    if ".lora_B." in key:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    weight = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    return weight


def expected_shapes(linears, spec: ModelSpec, r: int, expert_targets=()) -> dict[str, tuple[int, int]]:
    """Every PEFT key (and its whole shape) an adapter for these targets holds."""
    shapes = experts.expected_shapes(list(expert_targets), spec, r)
    for linear in linears:
        for t in linear.parts:
            if t.name in linear.chosen:
                for layer in linear.layers(spec):
                    shapes[peft_key(t.module_at(layer), "A")] = (r, t.in_features)
                    shapes[peft_key(t.module_at(layer), "B")] = (t.out_features, r)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]], where) -> None:
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    wrong = sorted(k for k in shapes if k in tensors and tuple(tensors[k].shape) != shapes[k])
    if missing or extra or wrong:
        raise AdapterError(f"{where} does not fit this model and LoRA config: missing {missing[:2]}, "
                           f"unexpected {extra[:2]}, wrong shape {wrong[:2]}")


def _submodule_parent(layer_module, path: str):
    *parents, attr = path.split(".")
    parent = layer_module
    for name in parents:
        parent = getattr(parent, name)
    return parent, attr


def _layer_pieces(linear, layer: int, spec: ModelSpec, layout: Layout, tp_rank: int, r: int):
    """Per chosen part: (A piece, B piece, local output positions) on this TP rank."""
    geo = layout.geometry(spec)
    axis = 1 if linear.parallel == targets.ROW else 0
    sizes = [(t.module_at(layer), t.in_features if axis else t.out_features) for t in linear.parts]
    placed = placements(linear.row.split, sizes, layout.tp, tp_rank, geo, axis)
    found = {}
    for t, where in zip(linear.parts, placed):
        if t.name not in linear.chosen:
            continue
        a_key, b_key = peft_key(t.module_at(layer), "A"), peft_key(t.module_at(layer), "B")
        if axis:  # row-parallel: A split along its input columns, B whole
            a = Piece(a_key, (r, t.in_features), 1, where.hf)
            b = Piece(b_key, (t.out_features, r), 0, torch.arange(t.out_features))
        else:  # column-parallel: A whole, B split along its output rows
            a = Piece(a_key, (r, t.in_features), 0, torch.arange(r))
            b = Piece(b_key, (t.out_features, r), 0, where.hf)
        found[t.name] = (a, b, where.local)
    return found


def apply_lora(model, family: Family, spec: ModelSpec, layout: Layout, tp_rank: int, pp_rank: int,
               settings: LoraSettings, base: dict, seed: int, initial: dict[str, torch.Tensor] | None = None,
               base_name: str | None = None) -> Adapter:
    """Freeze every base weight and wrap the targeted linears of this rank's layers; LoRA weights
    come from `initial` (whole PEFT tensors) or PEFT's initialisation."""
    linears, expert_targets = resolve_targets(family, spec, settings)
    experts.check_layout(layout.tp, expert_targets)
    for param in model.parameters():
        param.requires_grad_(False)
    dtype = next(model.parameters()).dtype
    adapter = Adapter(settings, base, base_name)

    def values(piece: Piece) -> torch.Tensor:
        whole = initial[piece.key] if initial is not None else peft_init(piece.key, piece.shape, seed)
        return piece.take(whole).to(dtype)

    for local, layer in enumerate(layout.stage_layers(spec, pp_rank)):
        if expert_targets and layer in experts.moe_layers(spec):
            _wrap_experts(model.decoder.layers[local].mlp.experts, expert_targets, layer, spec, settings, values, adapter)
        for linear in linears:
            if layer not in linear.layers(spec):
                continue
            found = _layer_pieces(linear, layer, spec, layout, tp_rank, settings.r)
            taken = {name: (values(a), values(b)) for name, (a, b, _) in found.items()}
            parent, attr = _submodule_parent(model.decoder.layers[local], linear.module)
            if hasattr(getattr(parent, attr), "layer_norm_weight"):  # TE's TELayerNormColumnParallelLinear
                raise AdapterError(f"{linear.module} has its input norm fused into it (the Transformer Engine spec): "
                                   "LoRA needs the local spec, where the adapter sees the normalised input")
            a_vals = {n: v[0] for n, v in taken.items()}
            b_vals = {n: v[1] for n, v in taken.items()}
            if linear.parallel == targets.ROW:
                wrapper = RowParallelLora(getattr(parent, attr), a_vals, b_vals, settings.scaling, settings.dropout)
            else:
                positions = {n: where for n, (_, _, where) in found.items()}
                wrapper = ColumnParallelLora(getattr(parent, attr), a_vals, b_vals, positions, settings.scaling,
                                             settings.dropout)
            setattr(parent, attr, wrapper)
            for name, (a, b, _) in found.items():
                a.param, b.param = wrapper.lora_A[name], wrapper.lora_B[name]
                adapter.pieces += [a, b]
    return adapter


def _wrap_experts(module, expert_targets, layer: int, spec: ModelSpec, settings: LoraSettings, values,
                  adapter: Adapter) -> None:
    """Wrap each local expert's linears of one MoE layer (megatron-core's SequentialMLP) with its
    expert's slice of the fused PEFT tensors (toolkit.lora.experts). The LoRA weights are tagged
    as expert parameters (allreduce=False), so that DeepSpeed reduces them over expert-DP only."""
    from megatron.core import parallel_state as ps

    r, count = settings.r, spec.num_experts
    local_experts = module.local_experts
    first = ps.get_expert_model_parallel_rank() * len(local_experts)
    for index, expert_module in enumerate(local_experts):
        rows, cols = experts.expert_rows(first + index, count, r)
        for t in expert_targets:
            a = Piece(t.key(layer, "A"), (count * r, t.in_features), 0, rows, expert=True)
            b = Piece(t.key(layer, "B"), (t.out_features, count * r), 1, cols, expert=True)
            if t.swapped:  # megatron-core's A is PEFT's B_e transposed, its B PEFT's A_e transposed
                a, b = dataclasses.replace(b, transposed=True), dataclasses.replace(a, transposed=True)
            base = getattr(expert_module, t.linear)
            if t.parallel == targets.ROW:
                wrapper = RowParallelLora(base, {t.name: values(a)}, {t.name: values(b)}, settings.scaling, 0.0)
            else:
                wrapper = ColumnParallelLora(base, {t.name: values(a)}, {t.name: values(b)}, {t.name: t.positions()},
                                             settings.scaling, 0.0)
            setattr(expert_module, t.linear, wrapper)
            a.param, b.param = wrapper.lora_A[t.name], wrapper.lora_B[t.name]
            for piece in (a, b):
                piece.param.allreduce = False  # megatron-core's tag on expert parameters
            adapter.pieces += [a, b]


def resolve_targets(family: Family, spec: ModelSpec, settings: LoraSettings):
    """(dense linears, routed expert targets) of the settings. A router's expert bias (DeepSeek-V3,
    GLM-4.5) is a buffer that stays as loaded: the trainer never calls megatron-core's
    finalize_model_grads, whose _update_router_expert_bias is the only writer, and HF's training
    leaves e_score_correction_bias alone too (tests/test_lora_moe.py)."""
    linears, parameters = peft_rewrites.split(settings.target_parameters)
    expert_targets = experts.resolve(family, spec, parameters, settings.dropout)
    modules = list(settings.target_modules) + list(linears)
    return targets.resolve(family, spec, modules, allow_none=bool(expert_targets)), expert_targets


def resolve_settings(family: Family, spec: ModelSpec, settings: LoraSettings) -> LoraSettings:
    """Refuse unknown target names and an r out of range, before any process starts; returns the
    settings with the target names spelled out (`all-linear` as the family's names, which is what
    adapter_config.json must list for PEFT to find the modules)."""
    linears, expert_targets = resolve_targets(family, spec, settings)
    targets.check_rank(settings.r, linears)
    smallest = min((min(t.in_features, t.out_features) for t in expert_targets), default=settings.r)
    if settings.r <= 0 or settings.r > smallest:
        raise AdapterError(f"LoRA r={settings.r} must be between 1 and {smallest} (the smallest dimension of the experts)")
    modules = tuple(n for linear in linears for n in linear.chosen)
    as_parameters = tuple(dict.fromkeys(n for n in modules if n in peft_rewrites.rewritten(family.model_types)))
    if as_parameters and settings.dropout:
        raise AdapterError(f"LoRA on {', '.join(as_parameters)} of {family.name} needs peft.dropout=0: PEFT rewrites "
                           "these target modules onto the routed experts, so the adapter lists them as target_parameters, "
                           f"which take no dropout (got {settings.dropout})")
    return dataclasses.replace(settings, target_modules=modules, as_parameters=as_parameters,
                               target_parameters=tuple(experts.config_names(expert_targets)))


def read_initial(adapter_dir, family: Family, spec: ModelSpec, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """An HF PEFT adapter's whole tensors, checked against the model and the settings."""
    tensors = peft_dir.read_tensors(adapter_dir)
    linears, expert_targets = resolve_targets(family, spec, settings)
    check_tensors(tensors, expected_shapes(linears, spec, settings.r, expert_targets), adapter_dir)
    return tensors
