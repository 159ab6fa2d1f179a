"""megatron-core parameter names: the canonical (Transformer Engine / dist-checkpoint) names used
by the family tables, the local-spec names, and PP-stage-local layer numbers."""

from __future__ import annotations

import re

# The local spec keeps separate norm modules; the TE spec folds them into the next linear.
# megatron-core's local spec maps them the same way in sharded_state_dict (gpt_layer_specs.py).
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
LOCAL_TO_TE = {v: k for k, v in TE_TO_LOCAL.items()}
# Modules whose `_extra_state` appears in a GPT layer's state dict (TE FP8 metadata; None locally).
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
LAYER_SPECS = ("te", "local")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def split_layer(name: str) -> tuple[int | None, str]:
    """'decoder.layers.3.mlp.x' -> (3, 'mlp.x'); other names -> (None, name)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_name(layer: int, suffix: str) -> str:
    return f"decoder.layers.{layer}.{suffix}"


def to_spec_name(canonical: str, layer_spec: str) -> str:
    """Canonical (TE) name -> the name used by `layer_spec`."""
    layer, suffix = split_layer(canonical)
    if layer is None or layer_spec == "te":
        return canonical
    return layer_name(layer, TE_TO_LOCAL.get(suffix, suffix))


def to_canonical(name: str) -> str:
    layer, suffix = split_layer(name)
    return name if layer is None else layer_name(layer, LOCAL_TO_TE.get(suffix, suffix))


def shift_layer(name: str, delta: int) -> str:
    layer, suffix = split_layer(name)
    return name if layer is None else layer_name(layer + delta, suffix)


def detect_layer_spec(names) -> str:
    return "local" if any(split_layer(n)[1] in LOCAL_TO_TE for n in names) else "te"
