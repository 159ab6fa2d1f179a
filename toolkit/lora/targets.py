"""Which linears of a family LoRA can adapt, named as HF PEFT names them.

Read from the family table (toolkit/families): every per-layer weight row with a linear split is
a megatron-core linear, and each of its HF tensors is one PEFT target module (`q_proj` inside
the fused `linear_qkv`, `gate_proj` inside `linear_fc1`, Phi-3's whole `qkv_proj`). A new family
therefore brings its LoRA targets with its table, and no family is named here.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import AdapterError
from toolkit.families import Family, ModelSpec
from toolkit.families.table import Row
from toolkit.splits import Split

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear but the output layer
COLUMN, ROW = "column", "row"
# Split kinds of linear weights; VOCAB (embedding, output layer) and REPLICATED (norms) are not targets.
# Qwen3-Next's re-laid ones (GATED_QKV, GDN_IN_PROJ) included: the adapter's rows are placed by the split itself
# (toolkit.lora.shards), so B follows the base weight's re-layout both ways. Qwen3.5's GDN_IN_PROJ_CAT: PEFT's one
# LoRA per HF Linear (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) is one (A, B) pair each inside megatron-core's
# one GatedDeltaNet.in_proj, A whole, B's rows on the rows of in_proj the split gives that tensor (per TP rank
# its chunk of q, k, v, z, beta, alpha). OLMo-Hybrid's GDN_IN_PROJ_EACH likewise, for its six Linears (q_proj, k_proj,
# v_proj, g_proj, b_proj, a_proj): without them `q_proj` would adapt its attention layers' q_proj only, where PEFT
# on the HF model adapts the gated delta net's q_proj too.
_COLUMN_SPLITS = (Split.COLUMN, Split.QKV, Split.GATE_UP, Split.HF_QKV, Split.HF_GATE_UP, Split.GATED_QKV,
                  Split.GDN_IN_PROJ, Split.GDN_IN_PROJ_CAT, Split.GDN_IN_PROJ_EACH, Split.GLOBAL_QKV,
                  Split.GLOBAL_QK,  # GLOBAL_*: Gemma 4's global layers
                  Split.MAMBA_IN_PROJ)  # Nemotron-H's in_proj, its z, x, B, C and dt rows each over TP


@dataclass(frozen=True)
class Target:
    """One HF module (q_proj) whose LoRA lives in one megatron-core linear (linear_qkv)."""

    name: str  # PEFT's target name: the module's last path component
    hf_module: str  # HF module path, `*` for the layer: model.layers.*.self_attn.q_proj
    in_features: int
    out_features: int

    def module_at(self, layer: int) -> str:
        return self.hf_module.replace("*", str(layer))


def router_names(family: Family) -> set[str]:
    """PEFT names of a Mixture-of-Experts router (`gate`), which LoRA does not adapt."""
    return {name.removesuffix(".weight").rsplit(".", 1)[-1] for row in family.rows
            if row.megatron.endswith("mlp.router.weight") for name in row.hf}


@dataclass(frozen=True)
class LinearTargets:
    """A megatron-core linear and the PEFT targets LoRA adapts inside it."""

    row: Row
    parallel: str  # COLUMN or ROW
    parts: tuple[Target, ...]  # every HF module of the row, in the row's order
    chosen: tuple[str, ...]  # the names of the parts adapted

    @property
    def module(self) -> str:
        """The megatron-core module path inside a layer: self_attention.linear_qkv."""
        return self.row.megatron.removeprefix("decoder.layers.*.").removesuffix(".weight")

    def layers(self, spec: ModelSpec) -> list[int]:
        """The layers holding this linear: a dense MLP only on the dense layers of a model that
        mixes them with Mixture-of-Experts layers, a shared expert only on the MoE ones."""
        return [layer for layer in range(spec.num_layers) if self.row.on_layer(layer, spec.moe_layers, spec.linear_layers)]


def linear_rows(family: Family, spec: ModelSpec) -> list[LinearTargets]:
    linears = []
    for row in family.rows_for(spec):
        # routed experts are PEFT target_parameters of the fused HF expert weights (toolkit.lora.experts)
        # a weight of one dimension is no linear (Nemotron-H's gated norm, split over TP as a COLUMN row)
        if not (row.per_layer and row.megatron.endswith(".weight")) or row.per_expert or len(row.shapes[0]) != 2:
            continue
        # a linear of a layer kind the model lacks (Nemotron-H's shared experts without an E layer)
        if not any(row.on_layer(n, spec.moe_layers, spec.linear_layers) for n in range(spec.num_layers)):
            continue
        if row.split is Split.ROW:
            parallel = ROW
        elif row.split in _COLUMN_SPLITS:
            parallel = COLUMN
        else:
            continue
        parts = tuple(
            Target(name.removesuffix(".weight").rsplit(".", 1)[1], module_name(family, name.removesuffix(".weight")),
                   spec.size_of(shape[1]), spec.size_of(shape[0]))
            for name, shape in zip(row.hf, row.shapes)
        )
        linears.append(LinearTargets(row, parallel, parts, ()))
    return linears


def module_name(family: Family, stored: str) -> str:
    """HF's module path of a tensor stored as `stored` (PEFT names an adapter's weights by the module)."""
    if family.module_prefix and stored.startswith(family.module_prefix[0]):
        return family.module_prefix[1] + stored.removeprefix(family.module_prefix[0])
    return stored


def available(family: Family, spec: ModelSpec) -> list[str]:
    return [t.name for linear in linear_rows(family, spec) for t in linear.parts]


def resolve(family: Family, spec: ModelSpec, target_modules: list[str], allow_none: bool = False) -> list[LinearTargets]:
    """The linears to wrap and their chosen parts; refuses a name the family does not have."""
    names = available(family, spec)
    wanted = set(names) if ALL_LINEAR in target_modules else set(target_modules)
    router = sorted(wanted & router_names(family))
    if router:
        raise AdapterError(f"LoRA on the Mixture-of-Experts router ({router[0]}) is not supported: the router is "
                           "kept frozen so that routing stays the base model's; leave it out of peft.target_modules "
                           "and peft.target_parameters")
    _refuse_what_peft_refuses(family, names, target_modules)
    unknown = sorted(wanted - set(names))
    if unknown:
        raise AdapterError(f"target module(s) {', '.join(unknown)} not in the {family.name} family "
                           f"(it has: {', '.join(names)}, or {ALL_LINEAR})")
    if not wanted and not allow_none:
        raise AdapterError("no target modules given")
    chosen = []
    for linear in linear_rows(family, spec):
        picked = tuple(t.name for t in linear.parts if t.name in wanted)
        if picked:
            chosen.append(LinearTargets(linear.row, linear.parallel, linear.parts, picked))
    return chosen


def _refuse_what_peft_refuses(family: Family, names: list[str], target_modules: list[str]) -> None:
    """A target PEFT refuses on the family's HF model (Family.peft_refused), named or taken by all-linear, which
    PEFT expands to every Linear but the output layer."""
    named = [n for n in target_modules if n in family.peft_refused]
    if named:
        raise AdapterError(f"LoRA on {named[0]} of {family.name} is not supported: {family.peft_refused[named[0]]}; "
                           f"leave it out of peft.target_modules")
    taken = [n for n in dict.fromkeys(names) if n in family.peft_refused]
    if ALL_LINEAR in target_modules and taken:
        others = ",".join(n for n in dict.fromkeys(names) if n not in family.peft_refused)
        raise AdapterError(f"peft.target_modules={ALL_LINEAR} on {family.name} takes {taken[0]}: "
                           f"{family.peft_refused[taken[0]]}; name the others instead: peft.target_modules={others}")


def check_rank(r: int, linears: list[LinearTargets]) -> None:
    """r must be positive and no larger than the smallest dimension of any adapted module."""
    targets = [t for linear in linears for t in linear.parts if t.name in linear.chosen]
    if not targets:
        return
    smallest = min(min(t.in_features, t.out_features) for t in targets)
    if r <= 0 or r > smallest:
        name = min(targets, key=lambda t: min(t.in_features, t.out_features)).name
        raise AdapterError(f"LoRA r={r} must be between 1 and {smallest} (the smallest dimension of the targets, {name})")
