"""Multi-latent attention (DeepSeek-V3, Kimi-K2: DeepseekV3Attention, transformers 5.23) as megatron-core
0.16.1's MLASelfAttention (transformer/multi_latent_attention.py) under its local layer spec
(gpt_layer_specs.py:366-392), read from config.json and mapped tensor by tensor.

HF, per token (modeling_deepseek_v3.py:426-482):
    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) where q_lora_rank is null
    q      = [q_nope (qk_nope_head_dim); q_rot (qk_rope_head_dim)] per head
    c, k_r = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])    (k_r shared by all heads)
    k_nope, v = split per head of kv_b_proj(kv_a_layernorm(c)), [qk_nope_head_dim, v_head_dim]
    RoPE on q_rot and k_r (rope_interleave: de-interleaved first), softmax scale 1 / sqrt(nope + rope)
    (times YaRN's mscale_all_dim factor squared: toolkit/families/yarn.py), o_proj over heads x v_head_dim
megatron-core does the same in the same order (get_query_key_value_tensors, :514-760): linear_q_down_proj,
q_layernorm, linear_q_up_proj (or linear_q_proj), split [qk_head_dim, qk_pos_emb_head_dim];
linear_kv_down_proj split [kv_lora_rank, qk_pos_emb_head_dim], kv_layernorm, linear_kv_up_proj split
per head [qk_head_dim, v_head_dim]; RoPE de-interleaves where multi_latent_attention (rope_utils.py:115-118).
Field names: megatron qk_head_dim = HF qk_nope_head_dim, qk_pos_emb_head_dim = qk_rope_head_dim.

Refused, each in one line: attention_bias (biases on q_a_proj, kv_a_proj_with_mqa and o_proj, which
MLASelfAttention builds with bias=False), rope_interleave=false (megatron-core always de-interleaves),
num_key_value_heads other than num_attention_heads (HF's eager attention would repeat the keys).
rms_norm_eps is the pre-norms' and the final norm's only: HF builds q_a_layernorm / kv_a_layernorm with the
RMSNorm's default eps 1e-6 whatever it says (Kimi-K2.5's is 1e-5), megatron-core with layernorm_epsilon, so
the layer spec builds those two at HF_LATENT_NORM_EPS (toolkit/blocks/norms.py LatentRMSNorm).

TP splits (local spec): the down projections are ColumnParallelLinear, their output rows split over TP
and all-gathered in forward (:593-619); the up projections split by heads, linear_proj by its input.
The TE spec replicates the down projections and folds the two norms into the up projections: not
written (refused in toolkit/convert/to_megatron.py).
"""

from __future__ import annotations

from toolkit.errors import ConversionError
from toolkit.families.llama import L, M
from toolkit.families.table import row
from toolkit.splits import Split

# HF's DeepseekV3RMSNorm / Mistral4RMSNorm default eps, which q_a_layernorm and kv_a_layernorm keep whatever
# rms_norm_eps says (modeling_deepseek_v3.py:39, :380, :392)
HF_LATENT_NORM_EPS = 1e-6

A = L + "self_attn."
S = M + "self_attention."
# Canonical names (the pre-norms TE's, as every table; the q / kv norms their local modules', as other
# families' q / k norms) with, where megatron-core's local MLA spec keys its torch_dist tensors
# otherwise (it has no sharded_state_dict_keys_map, so the pre-norms keep their module names), that key
# (Row.dist)
MLA_ROWS = (
    row(S + "linear_qkv.layer_norm_weight", L + "input_layernorm.weight", Split.REPLICATED, ("hidden",),
        dist=M + "input_layernorm.weight"),
    row(S + "linear_q_down_proj.weight", A + "q_a_proj.weight", Split.COLUMN, ("q_lora", "hidden"), when="q_lora"),
    row(S + "q_layernorm.weight", A + "q_a_layernorm.weight", Split.REPLICATED, ("q_lora",), when="q_lora"),
    row(S + "linear_q_up_proj.weight", A + "q_b_proj.weight", Split.COLUMN, ("q_heads", "q_lora"), when="q_lora"),
    row(S + "linear_q_proj.weight", A + "q_proj.weight", Split.COLUMN, ("q_heads", "hidden"), when="q_full"),
    row(S + "linear_kv_down_proj.weight", A + "kv_a_proj_with_mqa.weight", Split.COLUMN, ("kv_down", "hidden")),
    row(S + "kv_layernorm.weight", A + "kv_a_layernorm.weight", Split.REPLICATED, ("kv_lora",)),
    row(S + "linear_kv_up_proj.weight", A + "kv_b_proj.weight", Split.COLUMN, ("kv_up", "kv_lora")),
    row(S + "linear_proj.weight", A + "o_proj.weight", Split.ROW, ("hidden", "v_size")),
    row(M + "mlp.linear_fc1.layer_norm_weight", L + "post_attention_layernorm.weight", Split.REPLICATED, ("hidden",),
        dist=M + "pre_mlp_layernorm.weight"),
)

SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def read_mla(cfg: dict) -> dict:
    """ModelSpec.mla: q_lora_rank (None: a full q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim; refusing what MLASelfAttention computes otherwise."""
    if cfg.get("attention_bias"):
        raise ConversionError("deepseek_v3 with attention_bias=true cannot be mapped exactly to megatron-core: "
                              "MLASelfAttention has no biases on q_a_proj, kv_a_proj_with_mqa or o_proj")
    if cfg.get("rope_interleave", True) is not True:
        raise ConversionError(f"rope_interleave={cfg.get('rope_interleave')!r} cannot be mapped exactly to megatron-core:"
                              " its multi-latent attention always de-interleaves the rotary dimensions "
                              "(rope_utils.py:115-118)")
    if cfg.get("num_key_value_heads") != cfg.get("num_attention_heads"):
        raise ConversionError(f"num_key_value_heads={cfg.get('num_key_value_heads')!r} with num_attention_heads="
                              f"{cfg.get('num_attention_heads')!r}: multi-latent attention has a key and value per head "
                              "(HF would repeat them), so they must be equal")
    _refuse_yarn_otherwise(cfg)
    sizes = {key: cfg.get(key) for key in ("q_lora_rank", *SIZES)}
    for key, value in sizes.items():
        if not (type(value) is int and value >= 1) and not (key == "q_lora_rank" and value is None):
            raise ConversionError(f"config.json has {key}={value!r}; expected a positive integer"
                                  + (" or null" if key == "q_lora_rank" else ""))
    if sizes["qk_rope_head_dim"] % 2:
        raise ConversionError(f"qk_rope_head_dim={sizes['qk_rope_head_dim']} is odd: RoPE rotates pairs")
    return sizes


def _refuse_yarn_otherwise(cfg: dict) -> None:
    """YaRN as MLASelfAttention builds it (toolkit/megatron_settings.py mla_yarn): it always rounds the
    correction range (no correction_range_round_to_int, multi_latent_attention.py:138-149), and takes the
    softmax's mscale_all_dim and the cos / sin ratio from the same two fields."""
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type") != "yarn":
        return
    if params.get("truncate", True) is not True:
        raise ConversionError(f"rope_parameters.truncate={params['truncate']!r}: megatron-core 0.16.1's multi-latent "
                              "attention always rounds YaRN's correction range (truncate=true)")
    if params.get("mscale_all_dim") and not params.get("mscale"):
        raise ConversionError(f"rope_parameters.mscale_all_dim={params['mscale_all_dim']!r} without mscale cannot be "
                              "mapped exactly to megatron-core 0.16.1's multi-latent attention: HF then scales cos and "
                              "sin by get_mscale(factor) and the softmax by get_mscale(factor, mscale_all_dim)**2, "
                              "megatron-core takes both from mscale and mscale_all_dim together")
