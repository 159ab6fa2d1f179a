"""GLM-4.6V-Flash / GLM-4.1V-9B's dense language model (glm4v_text), published only inside the vision-language
wrappers Glm46VForConditionalGeneration (glm46v, whose text_config names glm4v_text for GLM-4.6V-Flash and
glm4v_moe_text for GLM-4.6V: toolkit/families/glm4v_moe.py) and Glm4vForConditionalGeneration (glm4v, GLM-4.1V-9B)
(toolkit/convert/wrapper.py): transformers 5.24 has no causal-LM class of it alone (Glm4vTextModel is the decoder
without the head). Piece by piece against modeling_glm4v.py:

  input_layernorm                   the norm before attention (Llama's row); Glm4vRMSNorm is plain w
  self_attn q/k/v_proj              with biases always (Glm4vTextAttention hard-codes bias=True, whatever
                                    attention_bias says), fused per query group as Qwen2's; o_proj without
  head_dim                          hidden_size // num_attention_heads, never a head_dim key (the attention
                                    never reads one; the rotary embedding would: one that differs is refused)
  post_self_attn_layernorm          on the attention output before the residual add: Gemma 3's post-norm
                                    (toolkit/blocks/linears.py PostNormRowParallelLinear) with plain w
  post_attention_layernorm          the norm before the MLP (Llama's row of that HF name)
  mlp.gate_up_proj, down_proj       one fused [gate; up] of [2 x ffn, hidden], SiLU-gated: Phi-3's HF_GATE_UP
  post_mlp_layernorm                on the MLP output before the residual add: Gemma 3's second post-norm
  the rotary embedding (MRoPE)      Glm4vTextRotaryEmbedding: cos/sin of position * inv_freq per stream (T, H, W)
                                    over int(head_dim * partial_rotary_factor) dims (0.5 as published:
                                    megatron-core's rotary_percent), chunks of mrope_section frequencies taken
                                    from T, H, W in turn, then each frequency repeated twice (repeat_interleave)
                                    and applied by rotate_half_llm to the pairs (0::2, 1::2): megatron-core's
                                    rotary_interleaved (rope_utils.py _rotate_half, rotary_pos_embedding.py's
                                    interleaved emb), the unrotated rest passed through as both do. For text the
                                    three streams hold the same positions (Glm4vTextModel: arange expanded to 3),
                                    so every chunk is T's: plain partial interleaved RoPE bit for bit
                                    (tests/test_family_glm4v.py)
  norm, embed_tokens, lm_head       Llama's; lm_head untied unless the wrapper's tie_word_embeddings"""

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.gemma3 import GEMMA3
from toolkit.families.llama import BY_NAME as LLAMA, L, M
from toolkit.families.phi3 import PHI3
from toolkit.families.qwen2 import QWEN2
from toolkit.families.table import CustomLayer, Family

_GEMMA3 = {r.megatron: r for r in GEMMA3.rows}
_PHI3 = {r.megatron: r for r in PHI3.rows}
QKV_BIAS = next(r for r in QWEN2.rows if r.megatron.endswith("linear_qkv.bias"))
POST_ATTENTION_NORM = replace(_GEMMA3[M + "self_attention.linear_proj.post_layernorm.weight"],
                              hf=(L + "post_self_attn_layernorm.weight",))
POST_MLP_NORM = replace(_GEMMA3[M + "mlp.linear_fc2.post_layernorm.weight"], hf=(L + "post_mlp_layernorm.weight",))


def read(cfg: dict) -> dict:
    """Refuse a head_dim other than hidden_size // num_attention_heads, the only one Glm4vTextAttention computes."""
    heads, hidden, head_dim = cfg.get("num_attention_heads"), cfg.get("hidden_size"), cfg.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and isinstance(hidden, int) and heads \
            and head_dim != hidden // heads:
        raise ConversionError(f"glm4v with head_dim={head_dim!r}: Glm4vTextAttention's heads are hidden_size // "
                              f"num_attention_heads = {hidden // heads} wide whatever head_dim says, its rotary "
                              "embedding reads head_dim: not one model to map")
    return {}


GLM4V = Family(
    name="glm4v",
    model_types=("glm4v_text",),
    architecture="Glm4vTextModel",
    rows=(
        LLAMA["embedding.word_embeddings.weight"],
        LLAMA[M + "self_attention.linear_qkv.layer_norm_weight"],
        LLAMA[M + "self_attention.linear_qkv.weight"],
        QKV_BIAS,
        LLAMA[M + "self_attention.linear_proj.weight"],
        POST_ATTENTION_NORM,
        LLAMA[M + "mlp.linear_fc1.layer_norm_weight"],
        _PHI3[M + "mlp.linear_fc1.weight"],
        LLAMA[M + "mlp.linear_fc2.weight"],
        POST_MLP_NORM,
        LLAMA["decoder.final_layernorm.weight"],
        LLAMA["output_layer.weight"],
    ),
    qkv_bias=True,
    partial_rotary=True,
    megatron={"rotary_interleaved": True},
    read=read,
    layer=CustomLayer(pre_norms=True, post_norms=True),
)
