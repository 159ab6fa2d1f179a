"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with Qwen3-MoE's routed
experts and router (softmax, top-k, renormalised iff `norm_topk_prob`), plus one shared expert of
width `shared_expert_intermediate_size` that every token goes through, scaled by
sigmoid(shared_expert_gate(x)): megatron-core's SharedExpertMLP with moe_shared_expert_gate
(toolkit/families/router.py). Dense layers (`mlp_only_layers`, `decoder_sparse_step`) as Qwen3-MoE's."""

from dataclasses import replace

from toolkit.families.experts import ATTENTION_ROWS, DENSE_LAYER_ROWS, GATE_PROJ_EXPERT_ROWS, shared_expert_rows
from toolkit.families.llama import L
from toolkit.families.qwen2 import QWEN2
from toolkit.families.qwen3_moe import QWEN3_MOE
from toolkit.families.table import Family

S = L + "mlp.shared_expert"
QKV_BIAS = tuple(r for r in QWEN2.rows if r.megatron.endswith("linear_qkv.bias"))

QWEN2_MOE = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architecture="Qwen2MoeForCausalLM",
    rows=ATTENTION_ROWS + QKV_BIAS + GATE_PROJ_EXPERT_ROWS
    + shared_expert_rows(S + ".gate_proj.weight", S + ".up_proj.weight", S + ".down_proj.weight", S + "_gate.weight")
    + DENSE_LAYER_ROWS,
    qkv_bias=True,
    refuse_flags=QWEN2.refuse_flags,
    # qkv_bias=false drops the biases (a config this table, with its bias rows, does not describe)
    accepted={"qkv_bias": (True,), "layer_types": ("full_attention",)},
    router=replace(QWEN3_MOE.router, shared_ffn_key="shared_expert_intermediate_size", shared_expert_gate=True),
)
