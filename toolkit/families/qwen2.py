"""Qwen2 / Qwen2.5: the Llama table plus q/k/v biases, fused per query group like the weights."""

from toolkit.families.llama import ROWS, L, M
from toolkit.families.table import Family, row
from toolkit.splits import Split

QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    architecture="Qwen2ForCausalLM",
    rows=ROWS
    + (
        row(
            M + "self_attention.linear_qkv.bias",
            (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"),
            Split.QKV,
            ("q_size",), ("kv_size",), ("kv_size",),
        ),
    ),
    qkv_bias=True,
    # Qwen2's per-layer sliding window (max_window_layers) has no exact megatron-core equivalent.
    refuse_flags=("use_sliding_window",),
)
