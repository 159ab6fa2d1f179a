"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with routed experts of
width `moe_intermediate_size` plus one shared expert of width `shared_expert_intermediate_size`
that every token goes through, scaled by sigmoid(shared_expert_gate(x)): megatron-core's
SharedExpertMLP with moe_shared_expert_gate (toolkit/families/router.py). Softmax over every
expert, top-k, renormalised iff `norm_topk_prob` (HF Qwen2MoeTopKRouter), as Qwen3-MoE."""

from toolkit.families.experts import ATTENTION_ROWS, expert_rows, shared_expert_rows
from toolkit.families.llama import L
from toolkit.families.qwen2 import QWEN2
from toolkit.families.router import SPARSE_PATTERN_EXACT, Router
from toolkit.families.table import Family

E = L + "mlp."
QKV_BIAS = tuple(r for r in QWEN2.rows if r.megatron.endswith("linear_qkv.bias"))

QWEN2_MOE = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architecture="Qwen2MoeForCausalLM",
    rows=ATTENTION_ROWS + QKV_BIAS
    + expert_rows(E + "gate.weight", E + "experts.#.gate_proj.weight", E + "experts.#.up_proj.weight",
                  E + "experts.#.down_proj.weight")
    + shared_expert_rows(E + "shared_expert.gate_proj.weight", E + "shared_expert.up_proj.weight",
                         E + "shared_expert.down_proj.weight", E + "shared_expert_gate.weight"),
    qkv_bias=True,
    refuse_flags=QWEN2.refuse_flags,
    # qkv_bias=false drops the biases (a config this table, with its bias rows, does not describe)
    accepted={"qkv_bias": (True,), "layer_types": ("full_attention",)},
    router=Router(
        experts_keys=("num_experts", "num_local_experts"),
        ffn_key="moe_intermediate_size",
        renormalise_key="norm_topk_prob",
        exact=SPARSE_PATTERN_EXACT,
        shared_ffn_key="shared_expert_intermediate_size",
        shared_expert_gate=True,
    ),
)
