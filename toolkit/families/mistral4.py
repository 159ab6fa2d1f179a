"""Mistral 4 / Mistral Small 4 (Mistral4ForCausalLM; published as the vision-language wrapper
Mistral3ForConditionalGeneration, whose language model this is: toolkit/convert/wrapper.py). transformers
5.24 builds it from DeepSeek-V3's modules (modular_mistral4.py), so this table is DeepSeek-V3's
(toolkit/families/deepseek_v3.py) with what differs, piece by piece against modeling_mistral4.py:

  self_attn (Mistral4Attention)     DeepSeek-V3's multi-latent attention (toolkit/families/mla.py), the same
                                    tensors, refusals and YaRN softmax scale (yarn_apply_mscale), plus the
                                    query times 1 + llama_4_scaling_beta * log(1 + floor(position /
                                    original_max_position_embeddings)) (get_llama_4_attn_scale), which is
                                    exactly 1 below original_max_position_embeddings (8192 as published):
                                    exact up to that many tokens (ModelSpec.exact_seq_len), longer refused
  rope_parameters                   partial_rotary_factor = qk_rope_head_dim / (qk_nope_head_dim +
                                    qk_rope_head_dim) of head_dim = qk_nope + qk_rope (DeepSeek-V3 sets
                                    head_dim = qk_rope_head_dim instead): the same qk_rope_head_dim rotated
                                    dimensions, megatron-core's qk_pos_emb_head_dim (Family.mla_rope_share)
  mlp.gate (Mistral4TopkRouter)     softmax over every expert (not sigmoid), no expert bias, in the model's
                                    dtype (no float32 router), top-k, renormalised where norm_topk_prob,
                                    times routed_scaling_factor: megatron-core's softmax router (top-k of the
                                    logits then softmax over the k where renormalised, else softmax then
                                    top-k; moe_router_topk_scaling_factor). HF's groups rank by the top-2 of
                                    the softmax scores, megatron-core's softmax router by the logits (or
                                    unrenormalised): exact only where no group is left out (n_group ==
                                    topk_group, 1 of 1 as published), others refused
  mlp.experts (Mistral4Experts)     transformers 5's fused experts, stored so in the checkpoint (mistral4 has no
                                    checkpoint conversion mapping to per-expert tensors): gate_up_proj
                                    [experts, 2 x ffn, hidden] = [gate; up], down_proj [experts, hidden, ffn],
                                    read and written per expert (toolkit/convert/fused_experts.py, FUSED_HALVES)
  shared_experts, dense layers      DeepSeek-V3's: one ungated MLP of n_shared_experts x moe_intermediate_size,
                                    Llama's MLP of intermediate_size below first_k_dense_replace
  norms, embeddings, head           RMSNorm (eps rms_norm_eps; the latent norms 1e-6 whatever it says, as
                                    DeepSeek-V3's), untied head unless tie_word_embeddings

No multi-token-prediction layer (HF's model has none to ignore)."""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.deepseek_v3 import DEEPSEEK_V3
from toolkit.families.llama import L
from toolkit.families.mla import read_mla
from toolkit.families.router import Router, positive
from toolkit.families.sigmoid_router import DEEPSEEK_ROUTER, read_sigmoid_routing
from toolkit.families.table import FUSED_HALVES, FusedExperts

# DeepSeek-V3's rows without the expert bias, the router weight as any other (Mistral 4 keeps none in float32)
ROWS = tuple(replace(r, float32_parameter=False) for r in DEEPSEEK_V3.rows if not r.float32_buffer)


def read_softmax_routing(cfg: dict) -> dict:
    """MoeFields of Mistral4TopkRouter: DeepSeek-V3's groups, scaling and shared experts (read and checked as
    sigmoid_router.py reads them), with softmax scores, no expert bias, and no group ever left out."""
    groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if type(groups) is int and type(group_topk) is int and group_topk < groups:
        raise ConversionError(f"n_group={groups}, topk_group={group_topk} cannot be mapped exactly to megatron-core: "
                              "HF ranks Mistral 4's groups by the top-2 of the softmax scores, megatron-core's softmax "
                              "router by the logits where it renormalises (exact only where n_group == topk_group)")
    # The sigmoid router's reading for what both share; its renormalisation rule is the sigmoid router's own
    fields = read_sigmoid_routing({**cfg, "norm_topk_prob": positive(cfg, "num_experts_per_tok") > 1})
    return {**fields, "score_function": "softmax", "expert_bias": False,
            "renormalise": bool(cfg.get("norm_topk_prob", False))}


def llama4_query_scale_bound(cfg: dict, model: str = "Mistral 4") -> int | None:
    """The longest sequence get_llama_4_attn_scale leaves exactly 1 (rope_parameters.original_max_position_embeddings;
    None without the scale, beta 0): ModelSpec.exact_seq_len of Mistral 4 and Ministral 3 (toolkit/families/ministral3.py)."""
    params = cfg.get("rope_parameters") or {}
    beta = params.get("llama_4_scaling_beta")
    if beta is None or isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise ConversionError(f"rope_parameters.llama_4_scaling_beta={beta!r}: {model} scales its queries by it "
                              "(a number; 0 for no scaling)")
    original = params.get("original_max_position_embeddings")
    if beta and not (type(original) is int and original >= 1):
        raise ConversionError(f"rope_parameters.original_max_position_embeddings={original!r}: {model}'s query scale "
                              "needs a positive integer")
    return int(original) if beta else None


def read(cfg: dict) -> dict:
    """DeepSeek-V3's multi-latent attention, with the rotary share and the Llama-4 query scale checked."""
    mla = read_mla(cfg)
    return {"mla": mla, "exact_seq_len": llama4_query_scale_bound(cfg)}


MISTRAL4 = replace(
    DEEPSEEK_V3,
    name="mistral4",
    model_types=("mistral4",),
    config_class_of={},
    architecture="Mistral4ForCausalLM",
    rows=ROWS,
    read=read,
    mtp_key=None,
    router=replace(DEEPSEEK_ROUTER, read=read_softmax_routing),
    fused_experts=FusedExperts(prefix=L + "mlp.experts.", per_expert=L + "mlp.experts.#.", gate_up="gate_up_proj",
                               down="down_proj", layout=FUSED_HALVES),
    mla_rope_share=True,
)
