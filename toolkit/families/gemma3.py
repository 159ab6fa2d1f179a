"""Gemma 3 (text): the Llama tensors plus a norm after attention and after the MLP, per-head q/k
norms, every norm computing (1 + w) in fp32, embeddings scaled by sqrt(hidden), GeGLU (tanh GELU),
local (sliding-window) layers with their own RoPE base between global ones, and a softmax scale of
query_pre_attn_scalar ** -0.5. megatron-core 0.16.1 has the window pattern (window_attn_skip_freq),
the softmax scale and the (1 + w) flag (layernorm_zero_centered_gamma); the rest is the toolkit's
block spec (toolkit/blocks/decoder_spec.py). The checkpoint keeps HF's w, never 1 + w, so bf16 round trips are
bit-exact. Names of the post-norms are Megatron-Bridge's."""

from toolkit.errors import ConversionError
from toolkit.families.llama import BY_NAME as LLAMA, L, M
from toolkit.families.table import CustomLayer, Family, row
from toolkit.splits import Split

LAYER_TYPES = {"sliding_attention": "1", "full_attention": "0"}


# Gemma3TextConfig derives layer_types (from sliding_window_pattern, or its default of every 6th
# layer global) and rope_parameters per layer type (from rope_theta / rope_local_base_freq, or
# its defaults 1e6 / 1e4): the values read here are always the class's (toolkit/families/hf_values.py).
def layer_types(cfg: dict, family: str = "gemma3") -> list:
    """config.json's layer_types (Gemma 3, gpt-oss), each a sliding-window or a full-attention layer."""
    types = cfg["layer_types"]
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ConversionError(f"{family} with layer_types[{i}]={t!r} cannot be mapped exactly to megatron-core")
    return types


def local_rope_theta(cfg: dict, family: str = "gemma3") -> float:
    """The RoPE base of the sliding-window layers, which get a RoPE of their own (toolkit/blocks/attention_self.py LayerRopeSelfAttention)."""
    local = cfg["rope_parameters"]["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ConversionError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r}: only the "
                              f"default RoPE on {family}'s local layers maps exactly to megatron-core")
    return float(local["rope_theta"])


def read(cfg: dict) -> dict:
    return {
        "window_layers": "".join(LAYER_TYPES[t] for t in layer_types(cfg)),
        "window_rope_theta": local_rope_theta(cfg),
        "softmax_scale": float(cfg["query_pre_attn_scalar"]) ** -0.5,
    }


GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    architecture="Gemma3ForCausalLM",
    rows=(
        LLAMA["embedding.word_embeddings.weight"],
        LLAMA[M + "self_attention.linear_qkv.layer_norm_weight"],
        LLAMA[M + "self_attention.linear_qkv.weight"],
        row(M + "self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight", Split.REPLICATED, ("head_dim",)),
        row(M + "self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight", Split.REPLICATED, ("head_dim",)),
        LLAMA[M + "self_attention.linear_proj.weight"],
        row(M + "self_attention.linear_proj.post_layernorm.weight", L + "post_attention_layernorm.weight",
            Split.REPLICATED, ("hidden",)),
        row(M + "mlp.linear_fc1.layer_norm_weight", L + "pre_feedforward_layernorm.weight", Split.REPLICATED, ("hidden",)),
        LLAMA[M + "mlp.linear_fc1.weight"],
        LLAMA[M + "mlp.linear_fc2.weight"],
        row(M + "mlp.linear_fc2.post_layernorm.weight", L + "post_feedforward_layernorm.weight",
            Split.REPLICATED, ("hidden",)),
        LLAMA["decoder.final_layernorm.weight"],
        LLAMA["output_layer.weight"],
    ),
    window_key="sliding_window",
    # Soft-capping (Gemma 2) has no megatron-core 0.16.1 setting; bidirectional attention is not causal.
    refuse_flags=("attention_bias", "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"),
    rope_types=("default", "linear"),
    rope_key="full_attention",
    activation=("hidden_activation", "gelu_pytorch_tanh"),
    megatron={"qk_layernorm": True, "layernorm_zero_centered_gamma": True},
    read=read,
    layer=CustomLayer(pre_norms=True, post_norms=True, qk_norm="head", embedding_scale=True),
)
