"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): Llama's attention with q/k/v biases where
`attention_bias`, per-head q/k RMSNorms before RoPE where `use_qk_norm` (megatron-core qk_layernorm),
RoPE on the first `partial_rotary_factor` of each head (rotary_percent); DeepSeek-V3's router and MoE
layout (toolkit/families/sigmoid_router.py): sigmoid scores with an expert bias, group-limited top-k,
routed_scaling_factor, ungated shared experts, dense layers below first_k_dense_replace.

The multi-token-prediction layer of the published checkpoints (num_nextn_predict_layers, stored as
`model.layers.<num_hidden_layers>.*`) is not part of HF's Glm4MoeForCausalLM, which ignores it on
load: the converter leaves it out too, with a line saying so (Family.mtp_key)."""

from dataclasses import replace

from toolkit.families.experts import ATTENTION_ROWS
from toolkit.families.llama import LLAMA
from toolkit.families.qwen2 import QWEN2
from toolkit.families.qwen3_moe import QK_NORMS
from toolkit.families.sigmoid_router import DEEPSEEK_MOE_ROWS, DEEPSEEK_ROUTER
from toolkit.families.table import Family

QKV_BIAS = tuple(replace(r, when="qkv_bias") for r in QWEN2.rows if r.megatron.endswith("linear_qkv.bias"))

GLM4_MOE = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architecture="Glm4MoeForCausalLM",
    rows=ATTENTION_ROWS + QKV_BIAS + tuple(replace(r, when="qk_norm") for r in QK_NORMS) + DEEPSEEK_MOE_ROWS,
    qkv_bias="attention_bias",
    partial_rotary=True,
    refuse_flags=tuple(f for f in LLAMA.refuse_flags if f != "attention_bias"),
    read=lambda cfg: {"qk_norm": bool(cfg.get("use_qk_norm", False))},
    mtp_key="num_nextn_predict_layers",
    router=DEEPSEEK_ROUTER,
)
