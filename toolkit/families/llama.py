"""Llama 2 / 3 / 3.1 / 3.2: GQA, SwiGLU, RMSNorm, RoPE (optionally llama3-scaled), tied or not."""

from toolkit.families.table import Family, row
from toolkit.splits import Split

L = "model.layers.*."
M = "decoder.layers.*."

ROWS = (
    row("embedding.word_embeddings.weight", "model.embed_tokens.weight", Split.VOCAB, ("vocab", "hidden")),
    row(M + "self_attention.linear_qkv.layer_norm_weight", L + "input_layernorm.weight", Split.REPLICATED, ("hidden",)),
    row(
        M + "self_attention.linear_qkv.weight",
        (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
        Split.QKV,
        ("q_size", "hidden"), ("kv_size", "hidden"), ("kv_size", "hidden"),
    ),
    row(M + "self_attention.linear_proj.weight", L + "self_attn.o_proj.weight", Split.ROW, ("hidden", "q_size")),
    row(M + "mlp.linear_fc1.layer_norm_weight", L + "post_attention_layernorm.weight", Split.REPLICATED, ("hidden",)),
    row(
        M + "mlp.linear_fc1.weight",
        (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
        Split.GATE_UP,
        ("ffn", "hidden"), ("ffn", "hidden"),
    ),
    row(M + "mlp.linear_fc2.weight", L + "mlp.down_proj.weight", Split.ROW, ("hidden", "ffn")),
    row("decoder.final_layernorm.weight", "model.norm.weight", Split.REPLICATED, ("hidden",)),
    row("output_layer.weight", "lm_head.weight", Split.VOCAB, ("vocab", "hidden")),
)

BY_NAME = {r.megatron: r for r in ROWS}  # for families that take some of these rows

LLAMA = Family(
    name="llama",
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    rows=ROWS,
    refuse_flags=("attention_bias", "mlp_bias"),
    rope_types=("default", "llama3"),
)
