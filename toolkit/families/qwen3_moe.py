"""Qwen3-MoE: Qwen3's attention (per-head q/k norms, explicit head_dim) with routed experts of
width `moe_intermediate_size`; softmax over every expert, top-k, renormalised iff `norm_topk_prob`
(HF Qwen3MoeTopKRouter), i.e. megatron-core's pre-softmax router when not renormalised. Layers in
`mlp_only_layers`, or off every `decoder_sparse_step`-th, are dense MLPs of width
`intermediate_size` (megatron-core's moe_layer_freq as a list)."""

from toolkit.families.experts import ATTENTION_ROWS, DENSE_LAYER_ROWS, GATE_PROJ_EXPERT_ROWS
from toolkit.families.qwen3 import QWEN3
from toolkit.families.router import Router, qwen_moe_layers
from toolkit.families.table import Family

QK_NORMS = tuple(r for r in QWEN3.rows if "layernorm" in r.megatron and "self_attention" in r.megatron
                 and "linear_qkv" not in r.megatron)

QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM",
    rows=ATTENTION_ROWS + QK_NORMS + GATE_PROJ_EXPERT_ROWS + DENSE_LAYER_ROWS,
    megatron=QWEN3.megatron,
    refuse_flags=QWEN3.refuse_flags,
    router=Router(
        experts_keys=("num_experts", "num_local_experts"),
        ffn_key="moe_intermediate_size",
        renormalise_key="norm_topk_prob",
        layers=qwen_moe_layers,
    ),
)
