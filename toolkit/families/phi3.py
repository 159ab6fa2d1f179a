"""Phi-3 / Phi-3.5 mini / Phi-4-mini: the Llama architecture with HF's q, k, v fused in one
`qkv_proj` and gate, up in one `gate_up_proj`, which megatron-core wants fused per query group and
per TP rank (the HF_QKV and HF_GATE_UP splits); an optional sliding window on every layer, as
Mistral's; RoPE on only the first partial_rotary_factor of each head (Phi-4-mini: 0.75), which is
megatron-core's rotary_percent; LongRoPE (the 128k variants, Phi-3.5-mini, Phi-4-mini) as the
toolkit's own rotary module (toolkit/blocks/rope_longrope.py)."""

from toolkit.families.table import Family, row
from toolkit.splits import Split

L = "model.layers.*."
M = "decoder.layers.*."

PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    architecture="Phi3ForCausalLM",
    rows=(
        row("embedding.word_embeddings.weight", "model.embed_tokens.weight", Split.VOCAB, ("vocab", "hidden")),
        row(M + "self_attention.linear_qkv.layer_norm_weight", L + "input_layernorm.weight", Split.REPLICATED, ("hidden",)),
        row(M + "self_attention.linear_qkv.weight", L + "self_attn.qkv_proj.weight", Split.HF_QKV, ("qkv_size", "hidden")),
        row(M + "self_attention.linear_proj.weight", L + "self_attn.o_proj.weight", Split.ROW, ("hidden", "q_size")),
        row(M + "mlp.linear_fc1.layer_norm_weight", L + "post_attention_layernorm.weight", Split.REPLICATED, ("hidden",)),
        row(M + "mlp.linear_fc1.weight", L + "mlp.gate_up_proj.weight", Split.HF_GATE_UP, ("2ffn", "hidden")),
        row(M + "mlp.linear_fc2.weight", L + "mlp.down_proj.weight", Split.ROW, ("hidden", "ffn")),
        row("decoder.final_layernorm.weight", "model.norm.weight", Split.REPLICATED, ("hidden",)),
        row("output_layer.weight", "lm_head.weight", Split.VOCAB, ("vocab", "hidden")),
    ),
    window_key="sliding_window",
    partial_rotary=True,
    rope_types=("default", "longrope"),
)
