"""LoRA on the routed experts, as HF PEFT's `target_parameters` expresses it for transformers 5's
fused expert weights.

transformers 5 keeps a MoE layer's experts as two 3-D parameters of one module, `model.layers.*.mlp.experts`
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5 alike; none transposed), or where the family's FusedExperts.prefix
says: Llama 4's `feed_forward.experts`, Gemma 4's `experts` (beside its dense `mlp`). adapter_config.json's
target_parameters name them under that module (`feed_forward.experts.gate_up_proj`), as PEFT matches them:
    gate_up_proj [E, 2I, H]  rows [gate; up] of each expert, = megatron-core's local expert linear_fc1
    down_proj    [E, H, I]                                    = megatron-core's local expert linear_fc2
gpt-oss stores them transposed (GptOssExperts, `is_transposed=True`: x @ W), gate_up_proj
[E, H, 2I] with gate and up interleaved (gate = [..., 0::2]), down_proj [E, I, H]. PEFT reads
`is_transposed` and keeps in = H, out = 2I there (no swap), so the LoRA tensors have the same
shapes and meaning, B's rows in HF's interleaved order: ExpertTarget.positions places them on
megatron-core's [gate; up] rows. The experts' biases are not adapted (PEFT's lora_bias is off).
Llama 4 stores them x @ W too (Llama4TextExperts: gate_up_proj [E, H, 2I] as [gate | up] halves, down_proj
[E, I, H]) without `is_transposed`: PEFT swaps in and out as for an nn.Linear-shaped weight, so its
in_features is megatron-core's output (2I for gate_up_proj, measured with peft 0.21.2: lora_A [E * r, 2I],
lora_B [H, E * r]) and its delta B_e A_e is added to W_e as stored, [H, 2I]: megatron-core's weight W_e^T
gains (B_e A_e)^T = A_e^T B_e^T. So there megatron-core's A is PEFT's B_e^T and its B PEFT's A_e^T
(ExpertTarget.swapped, FusedExperts.peft_reads_transposed).
PEFT's ParamWrapper (peft/tuners/lora/layer.py) gives each such parameter one pair
    lora_A [E * r, in], lora_B [out, E * r]
which is one rank-r LoRA per expert: expert e's A is rows e*r .. e*r+r-1 of lora_A, its B the
columns e, e+E, e+2E, ... of lora_B (get_delta_weight reshapes B to [out, r, E]), and its weight
gains scaling * B_e A_e. On gate_up_proj one A_e feeds both gate and up rows: LoRA on the fused
linear_fc1, exactly what wrapping megatron-core's expert linear_fc1 does.

PEFT nests the wrappers of one module in the order the module defines its parameters (measured
with peft 0.21.2: gate_up_proj inside, whichever order target_parameters lists them), and saves the
inner one under `<experts module>.base_layer.`: the keys follow FUSED's order.
PEFT refuses lora_dropout with target_parameters; so does this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import AdapterError
from toolkit.families import Family, ModelSpec
from toolkit.families.table import MOE_LAYER, layer_kind

EXPERTS_MODULE = "model.layers.*.mlp.experts"  # transformers 5's experts module, where the family fuses none itself
LAYER_PREFIX = "model.layers.*."  # what adapter_config.json's target_parameters leave out of the module's path
# PEFT's parameter name -> (megatron-core linear of each local expert, its parallel kind), in the order
# transformers' expert modules define them (PEFT's nesting, innermost first)
FUSED = {"gate_up_proj": ("linear_fc1", "column"), "down_proj": ("linear_fc2", "row")}


@dataclass(frozen=True)
class ExpertTarget:
    name: str  # gate_up_proj or down_proj
    linear: str  # linear_fc1 or linear_fc2 of each local expert
    parallel: str
    in_features: int  # PEFT's: lora_A [E * r, in_features]
    out_features: int  # lora_B [out_features, E * r]
    wrappers_after: int  # PEFT's wrappers nested outside this one (its `base_layer.` depth)
    module: str = EXPERTS_MODULE  # the HF experts module, `*` the layer
    interleaved: bool = False  # gate and up rows alternate in HF's gate_up_proj (gpt-oss)
    swapped: bool = False  # PEFT's in / out are megatron-core's out / in (Llama 4: see the docstring)

    @property
    def megatron_out(self) -> int:
        """The rows of the local expert's megatron-core linear."""
        return self.in_features if self.swapped else self.out_features

    def positions(self):
        """The row of the local expert's megatron-core linear each row of PEFT's delta (its output side:
        lora_B's rows, or where swapped lora_A's columns) adds to: the same row, or where HF interleaves
        gate and up (gate = rows 0::2) megatron-core's [gate; up]."""
        import torch

        rows = torch.arange(self.megatron_out)
        return rows // 2 + (rows % 2) * (self.megatron_out // 2) if self.interleaved else rows

    def key(self, layer: int, which: str) -> str:
        module = self.module.replace("*", str(layer)) + ".base_layer" * self.wrappers_after
        return f"base_model.model.{module}.lora_{which}.weight"

    @property
    def config_name(self) -> str:
        """adapter_config.json's name of it: `mlp.experts.gate_up_proj`, Llama 4's `feed_forward.experts.gate_up_proj`."""
        return f"{self.module.removeprefix(LAYER_PREFIX)}.{self.name}"


def experts_module(family: Family) -> str:
    """The family's HF experts module (`*` the layer): where its fused tensors live, else mlp.experts."""
    fused = family.fused_experts
    return fused.prefix.removesuffix(".") if fused is not None else EXPERTS_MODULE


def _peft_matches(given: str, module: str, name: str) -> bool:
    """PEFT matches a target parameter to `<module path>.<name>` when it is that key or a dotted suffix of it."""
    return name in FUSED and f".{module}.{name}".endswith(f".{given}")


def parameter_names(target_parameters) -> list[str]:
    """`mlp.experts.gate_up_proj` or `gate_up_proj` -> gate_up_proj."""
    return [name.strip().rsplit(".", 1)[-1] for name in target_parameters if name.strip()]


def resolve(family: Family, spec: ModelSpec, target_parameters, dropout: float) -> list[ExpertTarget]:
    """The fused expert parameters to adapt, in PEFT's order; refuses what PEFT cannot load."""
    given = [name.strip() for name in target_parameters if name.strip()]
    names = parameter_names(given)
    if not names:
        return []
    if not spec.is_moe:
        raise AdapterError(f"peft.target_parameters ({', '.join(given)}) adapts routed experts, which the "
                           f"{family.name} family does not have")
    ungated = [r for r in family.rows if r.per_expert and r.megatron.endswith("linear_fc1.weight") and len(r.hf) == 1]
    if ungated:  # Nemotron 3's experts: one up_proj per expert, no gate (NemotronHExperts, fused as up_proj [E, I, H])
        raise AdapterError(f"peft.target_parameters ({', '.join(given)}) on {family.name}'s routed experts is not "
                           f"supported: they have no gate ({ungated[0].hf[0]}), where LoRA on the experts here is on "
                           "a fused gate_up_proj; leave peft.target_parameters out (the shared experts' up_proj, "
                           "down_proj take LoRA as peft.target_modules)")
    module = experts_module(family)
    unknown = [g for g, n in zip(given, names) if not _peft_matches(g, module, n)]
    if unknown:
        have = ", ".join(f"{module.removeprefix(LAYER_PREFIX)}.{n}" for n in FUSED)
        raise AdapterError(f"target parameter(s) {', '.join(unknown)} are not fused expert weights of {family.name} "
                           f"(it has: {have}); LoRA on the router is not supported")
    if dropout:
        raise AdapterError(f"LoRA on the experts (peft.target_parameters) needs peft.dropout=0: PEFT adds it to the "
                           f"fused weight, where no dropout of the input can be applied (got {dropout})")
    chosen = [n for n in FUSED if n in names]
    ffn, hidden = spec.moe_ffn_hidden_size, spec.hidden_size
    shapes = {"gate_up_proj": (hidden, 2 * ffn), "down_proj": (ffn, hidden)}  # megatron-core's (in, out)
    fused = family.fused_experts
    # Family.fused_experts interleaved (gpt-oss): HF's checkpoint and module both interleave gate and up
    # (toolkit/families/table.py); the halves layout (Qwen3.5-MoE's) is transformers 5's module's everywhere
    interleaved = fused is not None and fused.interleaved
    swapped = fused is not None and fused.peft_reads_transposed
    return [ExpertTarget(n, *FUSED[n], *(shapes[n][::-1] if swapped else shapes[n]), len(chosen) - 1 - i, module,
                         interleaved and n == "gate_up_proj", swapped)
            for i, n in enumerate(chosen)]


def config_names(chosen: list[ExpertTarget]) -> list[str]:
    """adapter_config.json's target_parameters."""
    return [t.config_name for t in chosen]


def moe_layers(spec: ModelSpec) -> list[int]:
    return [layer for layer in range(spec.num_layers) if layer_kind(spec.moe_layers, layer) == MOE_LAYER]


def expected_shapes(chosen: list[ExpertTarget], spec: ModelSpec, r: int) -> dict[str, tuple[int, int]]:
    experts = spec.num_experts
    return {key: shape for t in chosen for layer in moe_layers(spec)
            for key, shape in ((t.key(layer, "A"), (experts * r, t.in_features)),
                               (t.key(layer, "B"), (t.out_features, experts * r)))}


def expert_rows(expert: int, experts: int, r: int):
    """(rows of lora_A, columns of lora_B) holding global expert `expert`'s A and B (see the docstring)."""
    import torch

    return torch.arange(expert * r, (expert + 1) * r), expert + experts * torch.arange(r)


def merge_delta(target: ExpertTarget, a, b, expert: int, experts: int, r: int, scaling: float):
    """Expert `expert`'s scaling * B_e A_e in fp32, as PEFT's get_delta_weight, as megatron-core's
    [out, in] (transposed where swapped), its rows in megatron-core's order (ExpertTarget.positions)."""
    rows, cols = expert_rows(expert, experts, r)
    delta = scaling * (b.float()[:, cols] @ a.float()[rows])
    delta = delta.T if target.swapped else delta
    return delta.new_empty(delta.shape).index_copy_(0, target.positions(), delta)


def check_layout(tp: int, chosen: list[ExpertTarget]) -> None:
    if chosen and tp > 1:
        raise AdapterError(f"LoRA on the experts (peft.target_parameters) at parallel.tp={tp} is not supported; "
                           "use tp=1 with parallel.ep")


def merge_slices(family: Family, spec: ModelSpec, chosen: list[ExpertTarget]) -> dict[str, tuple]:
    """HF checkpoint tensor name (one expert's w1 / gate_proj ...) -> (target, layer, expert, its
    rows of the fused weight), read from the family table's expert rows (`#` the expert)."""
    by_linear = {t.linear: t for t in chosen}
    found = {}
    for row in family.rows_for(spec):
        linear = row.megatron.rsplit(".", 2)[-2] if row.per_expert else None
        if linear not in by_linear or not row.megatron.endswith(".weight"):  # gpt-oss's expert biases: not adapted
            continue
        sizes = [spec.size_of(shape[0]) for shape in row.shapes]
        for layer in moe_layers(spec):
            for expert in range(spec.num_experts):
                start = 0
                for name, size in zip(row.hf_names(layer, expert), sizes):
                    found[name] = (by_linear[linear], layer, expert, slice(start, start + size))
                    start += size
    return found
