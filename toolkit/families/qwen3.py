"""Qwen3 (dense): the Llama table plus a per-head RMSNorm on queries and keys (megatron-core
`qk_layernorm`, applied per head after the projection, before RoPE, as HF's q_norm / k_norm),
with an explicit head_dim that need not be hidden_size / heads (megatron `kv_channels`)."""

from toolkit.families.llama import ROWS, L, M
from toolkit.families.table import Family, row
from toolkit.splits import Split

QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    architecture="Qwen3ForCausalLM",
    rows=ROWS
    + (
        row(M + "self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight", Split.REPLICATED, ("head_dim",)),
        row(M + "self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight", Split.REPLICATED, ("head_dim",)),
    ),
    megatron={"qk_layernorm": True},
    # Per-layer sliding windows (max_window_layers, layer_types) have no exact megatron-core equivalent.
    refuse_flags=("attention_bias", "use_sliding_window"),
    accepted={"layer_types": ("full_attention",)},
)
