"""megatron-core parameter names: the canonical (Transformer Engine / dist-checkpoint) names used
by the family tables, the local-spec names, and PP-stage-local layer numbers.

Mixture-of-Experts layers differ under the TE spec: the pre-MLP norm is its own module
(`pre_mlp_layernorm.weight`, gpt_layer_specs.py: TENorm when num_experts), and the experts are one
TEGroupedMLP whose i-th local expert is `mlp.experts.linear_fc1.weight{i}` (grouped GEMM). The
canonical names are the local spec's sharded keys: `mlp.linear_fc1.layer_norm_weight` and
SequentialMLP's `mlp.experts.local_experts.{i}.linear_fc1.weight`."""

from __future__ import annotations

import functools
import re
from typing import Container

# The local spec keeps separate norm modules; the TE spec folds them into the next linear.
# megatron-core's local spec maps them the same way in sharded_state_dict (gpt_layer_specs.py).
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # a hybrid model's Mamba-2 layer (Nemotron-H): its norm, fused into in_proj by the TE spec (MambaLayer's
    # sharded_state_dict_keys_map, toolkit/blocks/hybrid_spec.py)
    "mixer.in_proj.layer_norm_weight": "norm.weight",
}
LOCAL_TO_TE = {v: k for k, v in TE_TO_LOCAL.items()}
# Mamba-2's depthwise conv: torch_dist keys mixer.conv1d.weight / .bias on every release, the module's own names
# conv1d_weight / conv1d_bias from megatron-core 0.19 (megatron_versions.mamba_conv_names; mamba_conv_names_here)
MAMBA_CONV = ("mixer.conv1d.weight", "mixer.conv1d.bias")
LOCAL_TO_TE.update({"mixer.conv1d_weight": MAMBA_CONV[0], "mixer.conv1d_bias": MAMBA_CONV[1]})
# A gated delta net layer's input norm (Qwen3-Next), fused into its in_proj by the TE spec
# (experimental_attention_variant_module_specs.py:66-73); local to canonical depends on the layer's kind,
# which one name cannot say: canonical_names reads it from the layer's other names
GDN_INPUT_NORM = "self_attention.in_proj.layer_norm_weight"
TE_TO_LOCAL[GDN_INPUT_NORM] = "input_layernorm.weight"
# Modules whose `_extra_state` appears in a GPT layer's state dict (TE FP8 metadata; None locally).
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
LAYER_SPECS = ("te", "local")
# The names a conversion writes unless the model needs the other spec (ModelSpec.required_layer_spec):
# what GPU training builds
DEFAULT_LAYER_SPEC = "te"
# Attention modules with `_extra_state` in a Mixture-of-Experts layer; the experts add their own.
MOE_ATTENTION_EXTRA_STATE = EXTRA_STATE_MODULES[:2]
MLP_EXTRA_STATE = EXTRA_STATE_MODULES[2:]  # a dense layer's, after its attention's
# A shared expert (SharedExpertMLP) is an MLP of its own linears, under either spec.
SHARED_EXPERT_EXTRA_STATE = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
SHARED_EXPERT_PREFIX = "mlp.shared_experts."
TE_MOE_NORM = "pre_mlp_layernorm.weight"
ROUTER = "mlp.router.weight"

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def split_layer(name: str) -> tuple[int | None, str]:
    """'decoder.layers.3.mlp.x' -> (3, 'mlp.x'); other names -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_name(layer: int, suffix: str) -> str:
    return f"decoder.layers.{layer}.{suffix}"


@functools.cache
def mamba_conv_names_here() -> dict[str, str]:
    """MAMBA_CONV -> the installed megatron-core's state_dict names (imported where a Mamba layer is named)."""
    from toolkit.runtime.megatron_versions import mamba_conv_names

    return {canonical: f"mixer.{name}" for canonical, name in zip(MAMBA_CONV, mamba_conv_names())}


def to_spec_name(canonical: str, layer_spec: str, moe: bool = False) -> str:
    """Canonical (TE) name -> the name used by `layer_spec` (`moe`: of a Mixture-of-Experts layer)."""
    layer, suffix = split_layer(canonical)
    if layer is None:
        return canonical
    if suffix in MAMBA_CONV:  # under either spec: a parameter of the mixer, not a module
        return layer_name(layer, mamba_conv_names_here()[suffix])
    if layer_spec == "local":
        return layer_name(layer, TE_TO_LOCAL.get(suffix, suffix))
    if moe and suffix == LOCAL_TO_TE[TE_MOE_NORM]:
        return layer_name(layer, TE_MOE_NORM)
    expert = _LOCAL_EXPERT.match(suffix)
    if expert:
        index, module, kind = expert.groups()
        return layer_name(layer, f"mlp.experts.{module}.{kind}{index}")
    return canonical


def to_canonical(name: str) -> str:
    layer, suffix = split_layer(name)
    if layer is None:
        return name
    grouped = _GROUPED_EXPERT.match(suffix)
    if grouped:
        module, kind, index = grouped.groups()
        return layer_name(layer, f"mlp.experts.local_experts.{index}.{module}.{kind}")
    return layer_name(layer, LOCAL_TO_TE.get(suffix, suffix))


def canonical_names(names) -> dict[str, str]:
    """Each of a model's (or a rank file's) `names` -> its canonical name, a gated delta net layer's input
    norm included (to_canonical gives the attention's name, which the layer's in_proj corrects)."""
    names = list(names)
    linear = gdn_layers(names)
    out = {}
    for name in names:
        layer, suffix = split_layer(name)
        linear_norm = layer in linear and suffix == TE_TO_LOCAL[GDN_INPUT_NORM]
        out[name] = layer_name(layer, GDN_INPUT_NORM) if linear_norm else to_canonical(name)
    return out


def attention_linears(names) -> tuple[str, ...]:
    """The attention's linear modules among canonical layer tensor `names`, in order of appearance:
    those with an `_extra_state` (linear_qkv and linear_proj; multi-latent attention's down / up
    projections and linear_proj)."""
    found = (_ATTENTION_LINEAR.match(split_layer(n)[1]) for n in names)
    return tuple(dict.fromkeys(m.group(1) for m in found if m))


# and Gemma 4's dense MLP beside the experts in a MoE layer (toolkit/blocks/moe_layers.py Gemma4MoELayer), keyed with them
_ATTENTION_LINEAR = re.compile(r"^(self_attention\.linear_\w+|mlp\.dense\.linear_fc\d)\.(weight|bias|layer_norm_weight)$")


def extra_state_names(num_layers: int, local_experts: int, layer_spec: str, shared_expert: bool = False,
                      moe_layers: Container[int] | None = None,
                      attention: tuple[str, ...] = MOE_ATTENTION_EXTRA_STATE,
                      linear_layers: Container[int] = ()) -> list[str]:
    """`_extra_state` entries of a rank's state dict (TE FP8 metadata; None in our files).
    `moe_layers`: the (stage-local) layers with experts, where dense ones are mixed in; None: all.
    `attention`: the attention's linears (attention_linears); `linear_layers`: the (stage-local) gated
    delta net layers, whose linears are GDN_EXTRA_STATE instead."""
    shared = SHARED_EXPERT_EXTRA_STATE if shared_expert else ()
    if layer_spec == "te":
        moe = [*attention, *shared, "mlp.experts.linear_fc1", "mlp.experts.linear_fc2"]
    else:
        moe = [*attention, *shared] + [f"mlp.experts.local_experts.{i}.linear_fc{k}"
                                       for i in range(local_experts) for k in (1, 2)]
    dense = [*attention, *MLP_EXTRA_STATE]

    def modules(layer: int) -> list[str]:
        kind = moe if local_experts and (moe_layers is None or layer in moe_layers) else dense
        return [*GDN_EXTRA_STATE, *kind[len(attention):]] if layer in linear_layers else kind

    return [layer_name(layer, f"{module}._extra_state") for layer in range(num_layers) for module in modules(layer)]


# A gated delta net layer's linears (Qwen3-Next, ssm/gated_delta_net.py: in_proj, out_proj), in place of
# the attention's; its conv1d is a torch Conv1d, without one
GDN_EXTRA_STATE = ("self_attention.in_proj", "self_attention.out_proj")
GDN_IN_PROJ = "self_attention.in_proj.weight"


def gdn_layers(names) -> set[int]:
    """The layers of canonical or local `names` that are gated delta net layers."""
    return {layer for layer, suffix in map(split_layer, names) if suffix == GDN_IN_PROJ}


def router_layers(names) -> set[int]:
    """The layers of a state dict's `names` that hold a router: its Mixture-of-Experts layers."""
    return {layer for layer, suffix in map(split_layer, names) if suffix == ROUTER}


def shift_layer(name: str, delta: int) -> str:
    layer, suffix = split_layer(name)
    return name if layer is None else layer_name(layer + delta, suffix)


def detect_layer_spec(names) -> str:
    """The local spec has a separate input norm; TE fuses it into linear_qkv (dense and MoE alike), or into
    a Mamba-2 layer's in_proj."""
    local = (TE_TO_LOCAL["self_attention.linear_qkv.layer_norm_weight"], TE_TO_LOCAL["mixer.in_proj.layer_norm_weight"])
    return "local" if any(split_layer(n)[1] in local for n in names) else "te"


# The output layer's `_extra_state` (ColumnParallelLinear.get_extra_state: None), in a hybrid model's state
OUTPUT_LAYER_EXTRA_STATE = "output_layer._extra_state"
# A hybrid model's layers (Nemotron-H) by their pattern symbol: the linears with an `_extra_state` (a MoE layer's
# experts' too, one pair per local expert: hybrid_extra_state_names)
HYBRID_EXTRA_STATE = {"M": ("mixer.in_proj", "mixer.out_proj"), "*": EXTRA_STATE_MODULES[:2], "-": MLP_EXTRA_STATE,
                      "E": SHARED_EXPERT_EXTRA_STATE}


def hybrid_symbols(names) -> str | None:
    """The pattern symbol of each layer of canonical or local `names` (stage-local layers from 0) where they
    are a hybrid model's: "M" a Mamba-2 mixer, "*" attention without an MLP, "-" an MLP without attention, "E" a
    router and experts without attention;
    None where every layer has both attention and an MLP (a GPT model)."""
    held: dict[int, set[str]] = {}
    names = list(names)
    for layer, suffix in map(split_layer, names):
        if layer is not None:
            held.setdefault(layer, set()).add(suffix.split(".", 1)[0])
    experts = router_layers(names)
    symbols = ["M" if "mixer" in parts else ("E" if layer in experts else "-") if "self_attention" not in parts
               else "*" if "mlp" not in parts else "" for layer, parts in sorted(held.items())]
    return "".join(symbols) if all(symbols) and symbols else None


def hybrid_extra_state_names(symbols: str, local_experts: int = 0) -> list[str]:
    """`_extra_state` entries of a hybrid model's rank (its layers' `symbols`, hybrid_symbols; `local_experts` in each
    E layer, SequentialMLP's local_experts.{i})."""
    experts = tuple(f"mlp.experts.local_experts.{i}.linear_fc{k}" for i in range(local_experts) for k in (1, 2))
    return [layer_name(layer, f"{module}._extra_state") for layer, symbol in enumerate(symbols)
            for module in HYBRID_EXTRA_STATE[symbol] + (experts if symbol == "E" else ())]
