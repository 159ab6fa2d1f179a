"""OLMo 2: the Llama tensors with the norms moved after attention and after the MLP (on their
outputs, before the residual add; none before), and q/k RMSNorms over the whole q and k projection
(all heads at once, spanning TP ranks), not per head. The toolkit's block spec builds both
(toolkit/layers.py: PostNormRowParallelLinear, ProjectionRMSNorm)."""

from toolkit.families.gemma3 import POST_ATTENTION_NORM, POST_MLP_NORM
from toolkit.families.llama import BY_NAME as LLAMA, L, M
from toolkit.families.table import CustomLayer, Family, row
from toolkit.splits import Split

OLMO2 = Family(
    name="olmo2",
    model_types=("olmo2",),
    architecture="Olmo2ForCausalLM",
    rows=(
        LLAMA["embedding.word_embeddings.weight"],
        LLAMA[M + "self_attention.linear_qkv.weight"],
        row(M + "self_attention.q_layernorm.weight", L + "self_attn.q_norm.weight", Split.REPLICATED, ("q_size",)),
        row(M + "self_attention.k_layernorm.weight", L + "self_attn.k_norm.weight", Split.REPLICATED, ("kv_size",)),
        LLAMA[M + "self_attention.linear_proj.weight"],
        POST_ATTENTION_NORM,
        LLAMA[M + "mlp.linear_fc1.weight"],
        LLAMA[M + "mlp.linear_fc2.weight"],
        POST_MLP_NORM,
        LLAMA["decoder.final_layernorm.weight"],
        LLAMA["output_layer.weight"],
    ),
    refuse_flags=("attention_bias",),
    megatron={"qk_layernorm": True},
    layer=CustomLayer(pre_norms=False, post_norms=True, qk_norm="projection"),
)
