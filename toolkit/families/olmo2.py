"""OLMo 2: Gemma 3's tensors without the norms before attention and the MLP (OLMo 2 has only the
ones on their outputs, before the residual add), and with q/k RMSNorms over the whole q and k
projection (all heads at once, spanning TP ranks) instead of per head. Its norms are plain w, its
MLP SwiGLU, its embeddings unscaled, one RoPE base and no window. The toolkit's block spec builds
the layer (toolkit/blocks: linears.py PostNormRowParallelLinear, norms.py ProjectionRMSNorm)."""

from toolkit.families.gemma3 import GEMMA3
from toolkit.families.llama import M, L
from toolkit.families.table import CustomLayer, Family, row
from toolkit.splits import Split

PRE_NORMS = (M + "self_attention.linear_qkv.layer_norm_weight", M + "mlp.linear_fc1.layer_norm_weight")
WHOLE_PROJECTION_QK_NORMS = {
    M + "self_attention.q_layernorm.weight": row(M + "self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight",
                                                 Split.REPLICATED, ("q_size",)),
    M + "self_attention.k_layernorm.weight": row(M + "self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight",
                                                 Split.REPLICATED, ("kv_size",)),
}

OLMO2 = Family(
    name="olmo2",
    model_types=("olmo2",),
    architecture="Olmo2ForCausalLM",
    rows=tuple(WHOLE_PROJECTION_QK_NORMS.get(r.megatron, r) for r in GEMMA3.rows if r.megatron not in PRE_NORMS),
    refuse_flags=("attention_bias",),
    megatron={"qk_layernorm": True},
    layer=CustomLayer(pre_norms=False, post_norms=True, qk_norm="projection"),
)
