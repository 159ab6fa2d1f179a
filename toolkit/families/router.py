"""Mixture-of-Experts facts of a family: where its config.json keeps the experts, and how HF routes
tokens to them, read strictly (what megatron-core 0.16.1 cannot reproduce is refused, naming the
config field and its value).

HF's routers (Mixtral, Qwen3-MoE) take a softmax over all experts, keep the top k, then may
renormalise the k kept probabilities to sum to 1. megatron-core's TopKRouter
(transformer/moe/moe_utils.py topk_routing_with_score_function, score_function="softmax") does:
    pre_softmax=True:  softmax over all experts, then top-k           (HF without renormalising)
    pre_softmax=False: top-k of the logits, then softmax over those k (HF with renormalising:
                       exp(l_i) / sum over the k kept of exp(l_j) is the renormalised softmax)
with no scaling factor. The translation to those fields is toolkit/megatron_settings.py.

A shared expert (Qwen2-MoE) is an MLP every token goes through, added to the routed experts'
output; HF scales it by sigmoid(shared_expert_gate(x)), which is megatron-core's SharedExpertMLP
with moe_shared_expert_gate (transformer/moe/shared_experts.py:128-131: sigmoid(x @ gate_weight.T)
times the MLP's output, gate_weight [1, hidden] as HF's Linear(hidden, 1)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.errors import ConversionError

# megatron-core 0.16.1 could build the pattern (moe_layer_freq as a list, gpt_layer_specs.py:579-597),
# but a family table maps every layer alike (one `*` row set), so dense layers among MoE ones have
# no rows to convert: refused, not approximated.
ALL_LAYERS_SPARSE = ("dense MLP layers among the MoE layers (megatron-core's moe_layer_freq) are not supported: "
                     "the converter's family tables map every layer alike")
# HF Qwen2-MoE / Qwen3-MoE: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
SPARSE_PATTERN_EXACT = {"mlp_only_layers": ([], ALL_LAYERS_SPARSE), "decoder_sparse_step": (1, ALL_LAYERS_SPARSE)}


@dataclass(frozen=True)
class Router:
    experts_keys: tuple[str, ...]  # config.json keys holding the number of routed experts (first present wins)
    ffn_key: str  # config.json key holding one expert's FFN width
    # config.json flag saying whether the top-k probabilities are renormalised; None: always
    renormalise_key: str | None = None
    topk_key: str = "num_experts_per_tok"
    # config.json key of the load-balancing loss coefficient (HF adds it when output_router_logits)
    aux_loss_key: str = "router_aux_loss_coef"
    # config.json key -> (the only value megatron-core reproduces exactly, why others are refused)
    exact: dict[str, tuple[object, str]] = field(default_factory=dict, hash=False)
    # config.json key holding the shared expert's FFN width (None: no shared expert)
    shared_ffn_key: str | None = None
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(gate(x))


@dataclass(frozen=True)
class MoeFields:
    num_experts: int
    topk: int
    ffn_hidden_size: int
    renormalise: bool
    aux_loss_coeff: float
    shared_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False

    def spec_fields(self) -> dict:
        """As ModelSpec fields."""
        return dict(num_experts=self.num_experts, moe_topk=self.topk, moe_ffn_hidden_size=self.ffn_hidden_size,
                    moe_renormalise=self.renormalise, moe_aux_loss_coeff=self.aux_loss_coeff,
                    moe_shared_ffn_hidden_size=self.shared_ffn_hidden_size, moe_shared_expert_gate=self.shared_expert_gate)


def read_moe(cfg: dict, family_name: str, router: Router) -> MoeFields:
    for key, (value, why) in router.exact.items():
        if key in cfg and cfg[key] is not None and cfg[key] != value:
            raise ConversionError(f"{family_name} with {key}={cfg[key]!r} cannot be mapped exactly to megatron-core: {why}")
    key = next((k for k in router.experts_keys if cfg.get(k) is not None), router.experts_keys[0])
    experts, topk = _positive(cfg, key), _positive(cfg, router.topk_key)
    if topk > experts:
        raise ConversionError(f"{router.topk_key}={topk} is more than the {experts} experts ({key}): "
                              "a token cannot be routed to more experts than there are")
    renormalise = True if router.renormalise_key is None else bool(cfg.get(router.renormalise_key, False))
    aux = cfg.get(router.aux_loss_key) or 0.0
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0.0 <= aux < float("inf"):
        raise ConversionError(f"config.json has {router.aux_loss_key}={aux!r}; expected a finite number >= 0")
    shared = _positive(cfg, router.shared_ffn_key) if router.shared_ffn_key else 0
    return MoeFields(experts, topk, _positive(cfg, router.ffn_key), renormalise, float(aux), shared,
                     router.shared_expert_gate)


def _positive(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if type(value) is not int or value < 1:
        raise ConversionError(f"config.json has {key}={value!r}; a Mixture-of-Experts model needs a positive integer")
    return value
