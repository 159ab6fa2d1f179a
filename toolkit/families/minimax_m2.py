"""MiniMax-M2 / M2.1 / M2.5 / M2.7 (MiniMaxM2ForCausalLM, transformers 5.24 modeling_minimax_m2.py):
OLMoE's attention (GQA, q/k RMSNorms over the whole q and the whole k projection, all heads at once:
`q_norm` of width heads x head_dim, `k_norm` of kv_heads x head_dim, before RoPE; toolkit/blocks/norms.py
ProjectionRMSNorm) with RoPE on the first `rotary_dim` of each head (transformers reads the legacy
`rotary_dim` as partial_rotary_factor = rotary_dim / head_dim: megatron-core's rotary_percent), and
every layer a Mixture-of-Experts layer stored as Mixtral's (`block_sparse_moe.gate`, `experts.#.w1/w3/w2`)
with DeepSeek-V3's kind of router, without groups, scaling or shared experts:

HF (MiniMaxM2TopKRouter, per token, in fp32):
    scores  = sigmoid(x @ W.T)
    experts = top-k of scores + e_score_correction_bias          (the bias selects, never weighs)
    weights = scores[experts] / sum(scores[experts])             (always renormalised, any k)
megatron-core (moe_utils.py topk_routing_with_score_function, score_function="sigmoid", expert_bias):
the same, dividing by (sum + 1e-20) where k > 1 (0.16.1 moe_utils.py:724, 0.19.2 :867): 1e-20 is below
half an ulp of any sum of k sigmoids above 2e-13, so the division is HF's bit for bit; for k = 1 it keeps
the score itself where HF's weight is 1, so num_experts_per_tok=1 is refused. The bias is megatron-core's
float32 expert_bias buffer, HF's `block_sparse_moe.e_score_correction_bias` (the published checkpoints
store it, and the router weight, in float32 among bf16 and FP8 weights: converted as stored).

transformers' class reads, but its model never consults, the published keys of MiniMax's own remote code
(scoring_func, use_routing_bias, use_qk_norm, qk_norm_type, shared_intermediate_size, attn_type_list):
each is accepted only at the value under which that code computes what HF's class does. use_mtp /
num_mtp_modules / mtp_transformer_layers name multi-token-prediction modules the published checkpoints
do not hold (228.7B parameters, every tensor a decoder layer's, the embeddings, the final norm or the head)
and HF's model does not build: nothing to convert."""

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.experts import ATTENTION_ROWS, expert_rows
from toolkit.families.llama import L, M
from toolkit.families.olmo2 import WHOLE_PROJECTION_QK_NORMS
from toolkit.families.router import Router, positive
from toolkit.families.table import MOE_LAYER, CustomLayer, Family, row
from toolkit.splits import Split

E = L + "block_sparse_moe."

# The router weight, float32 in the published checkpoints whatever the weights' dtype
ROUTER_ROWS = tuple(replace(r, float32_parameter=r.megatron.endswith("mlp.router.weight")) for r in expert_rows(
    E + "gate.weight", E + "experts.#.w1.weight", E + "experts.#.w3.weight", E + "experts.#.w2.weight"))
EXPERT_BIAS = row(M + "mlp.router.expert_bias", E + "e_score_correction_bias", Split.REPLICATED, ("experts",),
                  kind=MOE_LAYER, float32_buffer=True)


def read_minimax_routing(cfg: dict) -> dict:
    """MoeFields of the sigmoid router with expert bias, always renormalised (k > 1)."""
    topk = positive(cfg, "num_experts_per_tok")
    if topk == 1:
        raise ConversionError("minimax_m2 with num_experts_per_tok=1 cannot be mapped exactly to megatron-core: HF "
                              "divides the top-k weights by their sum for every k (one expert weighs 1), megatron-core's "
                              "sigmoid router only where k > 1 (moe_utils.py topk_routing_with_score_function)")
    return dict(score_function="sigmoid", expert_bias=True, renormalise=True)


def read_rotary_dim(cfg: dict) -> dict:
    """The published `rotary_dim` as the installed MiniMaxM2Config reads it: transformers 5.24 turns it into
    partial_rotary_factor; 5.17's class ignores it (whole-head RoPE, not the published model): refused there."""
    rotary_dim, head_dim = cfg.get("rotary_dim"), cfg.get("head_dim")
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if isinstance(rotary_dim, int) and isinstance(head_dim, int) and int(head_dim * factor) != rotary_dim:
        raise ConversionError(f"config.json has rotary_dim={rotary_dim} (of head_dim {head_dim}), which the installed "
                              f"transformers' MiniMaxM2Config does not read (its RoPE would rotate {int(head_dim * factor)} "
                              "dimensions): use a transformers that does (5.24 does)")
    return {}


MINIMAX_M2 = Family(
    name="minimax_m2",
    model_types=("minimax_m2",),
    architecture="MiniMaxM2ForCausalLM",
    rows=ATTENTION_ROWS + tuple(WHOLE_PROJECTION_QK_NORMS.values()) + ROUTER_ROWS + (EXPERT_BIAS,),
    refuse_flags=("attention_bias",),
    partial_rotary=True,
    # MiniMax's remote-code switches, at the one value that computes what transformers' class computes
    accepted={"scoring_func": ("sigmoid",), "use_routing_bias": (True,), "use_qk_norm": (True,),
              "qk_norm_type": ("per_layer",), "shared_intermediate_size": (0,), "attn_type_list": (1,)},
    megatron={"qk_layernorm": True},
    router=Router(
        experts_keys=("num_local_experts",),
        ffn_key="intermediate_size",
        exact={"router_jitter_noise": (0.0, "HF scales the experts' input by the noise too, megatron-core's "
                                            "moe_input_jitter_eps only the router's (transformer/moe/router.py)")},
        read=read_minimax_routing,
    ),
    layer=CustomLayer(pre_norms=True, post_norms=False, qk_norm="projection"),
    read=read_rotary_dim,
)
