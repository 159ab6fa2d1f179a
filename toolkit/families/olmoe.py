"""OLMoE: Llama's tensors with OLMo 2's q/k RMSNorms over the whole q and k projection (all heads,
spanning TP ranks; toolkit/blocks/norms.py ProjectionRMSNorm) and routed experts of width
`intermediate_size` in place of the MLP; the norms before attention and the MLP are the usual
pre-norms. Softmax over every expert, top-k, renormalised iff `norm_topk_prob` (HF
OlmoeTopKRouter), as Qwen3-MoE. HF's clip_qkv clamps q, k and v, which megatron-core cannot."""

from toolkit.families.experts import ATTENTION_ROWS, GATE_PROJ_EXPERT_ROWS
from toolkit.families.olmo2 import WHOLE_PROJECTION_QK_NORMS
from toolkit.families.router import Router
from toolkit.families.table import CustomLayer, Family

OLMOE = Family(
    name="olmoe",
    model_types=("olmoe",),
    architecture="OlmoeForCausalLM",
    rows=ATTENTION_ROWS + tuple(WHOLE_PROJECTION_QK_NORMS.values()) + GATE_PROJ_EXPERT_ROWS,
    refuse_flags=("attention_bias", "clip_qkv"),
    megatron={"qk_layernorm": True},
    router=Router(experts_keys=("num_experts", "num_local_experts"), ffn_key="intermediate_size",
                  renormalise_key="norm_topk_prob"),
    layer=CustomLayer(pre_norms=True, post_norms=False, qk_norm="projection"),
)
