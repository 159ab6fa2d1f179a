"""The DeepSeek-V3 router, which GLM-4.5 reuses, read from config.json and mapped to megatron-core's
sigmoid router; with it the MoE layout those families share (shared experts, first dense layers).

HF (Glm4MoeTopkRouter / DeepseekV3TopkRouter, transformers 5.23), per token, in fp32:
    scores  = sigmoid(x @ W.T)
    choice  = scores + e_score_correction_bias                       (the bias selects, never weighs)
    groups  = the topk_group of n_group groups with the largest sum of their top-2 `choice`
    experts = top-k of `choice` within those groups
    weights = scores[experts] / (sum + 1e-20) if norm_topk_prob, then * routed_scaling_factor
megatron-core 0.16.1 (moe_utils.py topk_routing_with_score_function, score_function="sigmoid",
expert_bias; group_limited_topk) computes the same, in the same order, with two differences that are
refused rather than approximated:
  * it renormalises the k weights exactly where k > 1 (moe_utils.py:724 `probs = scores / (sum +
    1e-20) if topk > 1`): exact where norm_topk_prob is (k > 1);
  * it ranks groups by the sum of their top-(topk // group_topk) scores (moe_utils.py:554), HF by
    their top-2: group-limited routing is exact where topk // topk_group == 2 (DeepSeek-V3: 8 // 4),
    or where no group is ever left out (n_group == topk_group, GLM-4.5's 1 of 1), which is plain top-k.
The bias is megatron-core's `expert_bias` buffer (router.py:173, moe_router_enable_expert_bias),
float32 as HF keeps e_score_correction_bias; the router runs in fp32 (moe_router_dtype) as HF's.

Shared experts: n_shared_experts MLPs of width moe_intermediate_size, which HF fuses into one MLP of
width n_shared_experts * moe_intermediate_size with no gate: megatron-core's SharedExpertMLP of that
width. Layers below first_k_dense_replace are dense MLPs of width intermediate_size.
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.experts import DENSE_LAYER_ROWS, GATE_PROJ_EXPERT_ROWS, shared_expert_rows
from toolkit.families.llama import L, M
from toolkit.families.router import Router, positive
from toolkit.families.table import MOE_LAYER, row
from toolkit.splits import Split

# HF ranks groups by the sum of their top-2 scores (a constant in both families' routers)
HF_GROUP_SCORE_TOPK = 2


def first_dense_layers(cfg: dict) -> str:
    """Per layer "0" (dense) below first_k_dense_replace, "1" (MoE) from there on."""
    layers, dense = positive(cfg, "num_hidden_layers"), cfg.get("first_k_dense_replace", 0)
    if type(dense) is not int or not 0 <= dense < layers:
        raise ConversionError(f"config.json has first_k_dense_replace={dense!r}; expected an integer in [0, "
                              f"num_hidden_layers={layers}) (at least one Mixture-of-Experts layer)")
    return "0" * dense + "1" * (layers - dense)


def read_sigmoid_routing(cfg: dict) -> dict:
    """MoeFields of the sigmoid router with expert bias, group-limited top-k, scaling and shared experts."""
    experts, topk = positive(cfg, "n_routed_experts"), positive(cfg, "num_experts_per_tok")
    renormalise = bool(cfg.get("norm_topk_prob", False))
    if renormalise != (topk > 1):
        raise ConversionError(f"norm_topk_prob={str(renormalise).lower()} with num_experts_per_tok={topk} cannot be mapped "
                              "exactly to megatron-core: its sigmoid router renormalises the top-k weights exactly where "
                              "k > 1 (moe_utils.py:724)")
    groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if type(groups) is not int or type(group_topk) is not int or not 1 <= group_topk <= groups or experts % groups:
        raise ConversionError(f"config.json has n_group={groups!r}, topk_group={group_topk!r}; expected integers with "
                              f"1 <= topk_group <= n_group and n_group dividing n_routed_experts={experts}")
    limited = group_topk < groups
    if limited and topk // group_topk != HF_GROUP_SCORE_TOPK:
        raise ConversionError(f"n_group={groups}, topk_group={group_topk} with num_experts_per_tok={topk} cannot be "
                              f"mapped exactly to megatron-core: it ranks groups by their top-{topk // group_topk} "
                              f"scores, HF by their top-{HF_GROUP_SCORE_TOPK} (exact only where num_experts_per_tok "
                              f"// topk_group == {HF_GROUP_SCORE_TOPK})")
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0.0 < scaling < float("inf"):
        raise ConversionError(f"config.json has routed_scaling_factor={scaling!r}; expected a finite number > 0")
    return dict(score_function="sigmoid", expert_bias=True, renormalise=renormalise,
                num_groups=groups if limited else None, group_topk=group_topk if limited else None,
                scaling_factor=None if scaling == 1.0 else float(scaling),
                shared_ffn_hidden_size=positive(cfg, "n_shared_experts") * positive(cfg, "moe_intermediate_size"))


SHARED = L + "mlp.shared_experts."
EXPERT_BIAS = row(M + "mlp.router.expert_bias", L + "mlp.gate.e_score_correction_bias", Split.REPLICATED,
                  ("experts",), kind=MOE_LAYER, float32_buffer=True)
# The router weight, which transformers >= 5.24 keeps in float32 as well (_keep_in_fp32_modules_strict
# `gate.weight`; 5.23 lists the bias alone) and saves so: a checkpoint may hold it in either dtype
FLOAT32_ROUTER = tuple(replace(r, float32_parameter=r.megatron.endswith("mlp.router.weight"))
                       for r in GATE_PROJ_EXPERT_ROWS)
# DeepSeek-V3's MoE layout, as GLM-4.5 names it too: the router with its bias, routed experts, the
# fused shared experts, dense MLPs below first_k_dense_replace
DEEPSEEK_MOE_ROWS = (FLOAT32_ROUTER + (EXPERT_BIAS,)
                     + shared_expert_rows(SHARED + "gate_proj.weight", SHARED + "up_proj.weight",
                                          SHARED + "down_proj.weight") + DENSE_LAYER_ROWS)
DEEPSEEK_ROUTER = Router(experts_keys=("n_routed_experts",), ffn_key="moe_intermediate_size",
                         renormalise_key="norm_topk_prob", layers=first_dense_layers, read=read_sigmoid_routing)
