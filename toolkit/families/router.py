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

from dataclasses import dataclass, field, replace
from typing import Callable

from toolkit.errors import ConversionError


def qwen_moe_layers(cfg: dict) -> str:
    """HF Qwen2-MoE / Qwen3-MoE (Qwen*MoeDecoderLayer.__init__): layer i is MoE iff i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else a dense MLP of width
    intermediate_size. Per layer "1" / "0", megatron-core's moe_layer_freq as a list."""
    layers, step = cfg.get("num_hidden_layers"), cfg.get("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if type(layers) is not int or layers < 1:
        raise ConversionError(f"config.json has num_hidden_layers={layers!r}; expected a positive integer")
    if type(step) is not int or step < 1:
        raise ConversionError(f"config.json has decoder_sparse_step={step!r}; expected a positive integer")
    if not isinstance(dense, list) or not all(type(i) is int and 0 <= i < layers for i in dense):
        raise ConversionError(f"config.json has mlp_only_layers={dense!r}; expected a list of layer indices "
                              f"below num_hidden_layers={layers}")
    pattern = "".join("1" if i not in dense and (i + 1) % step == 0 else "0" for i in range(layers))
    if "1" not in pattern:
        raise ConversionError(f"mlp_only_layers={dense!r} with decoder_sparse_step={step} leave no Mixture-of-Experts "
                              "layer: HF builds a dense model with no router, which this family's table does not describe")
    return pattern


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
    # Which layers are MoE (per layer "1" / "0") where a family mixes dense layers in; None: every layer
    layers: Callable[[dict], str] | None = field(default=None, hash=False)
    # More MoeFields read from config.json (cfg -> dict of MoeFields fields), refusing what is not
    # exact: the sigmoid router of DeepSeek-V3 / GLM-4.5 (toolkit/families/sigmoid_router.py)
    read: Callable[[dict], dict] | None = field(default=None, hash=False)
    # config.json flag that turns the experts on (Gemma 4's enable_moe_block), or a test of the config (Nemotron-H:
    # an 'E' in its layer pattern); None: a MoE family always has them
    when: str | Callable[[dict], bool] | None = None

    def applies(self, cfg: dict) -> bool:
        """Whether the model of `cfg` has experts."""
        if self.when is None:
            return True
        return bool(self.when(cfg) if callable(self.when) else cfg.get(self.when))


@dataclass(frozen=True)
class MoeFields:
    num_experts: int
    topk: int
    ffn_hidden_size: int
    renormalise: bool
    aux_loss_coeff: float
    shared_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    layers: str | None = None  # per layer "1" MoE / "0" dense; None: every layer MoE
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None

    def spec_fields(self) -> dict:
        """As ModelSpec fields."""
        return dict(num_experts=self.num_experts, moe_topk=self.topk, moe_ffn_hidden_size=self.ffn_hidden_size,
                    moe_renormalise=self.renormalise, moe_aux_loss_coeff=self.aux_loss_coeff,
                    moe_shared_ffn_hidden_size=self.shared_ffn_hidden_size, moe_shared_expert_gate=self.shared_expert_gate,
                    moe_layers=self.layers, moe_score_function=self.score_function, moe_expert_bias=self.expert_bias,
                    moe_num_groups=self.num_groups, moe_group_topk=self.group_topk,
                    moe_scaling_factor=self.scaling_factor)


def read_moe(cfg: dict, family_name: str, router: Router) -> MoeFields:
    for key, (value, why) in router.exact.items():
        if key in cfg and cfg[key] is not None and cfg[key] != value:
            raise ConversionError(f"{family_name} with {key}={cfg[key]!r} cannot be mapped exactly to megatron-core: {why}")
    key = next((k for k in router.experts_keys if cfg.get(k) is not None), router.experts_keys[0])
    experts, topk = positive(cfg, key), positive(cfg, router.topk_key)
    if topk > experts:
        raise ConversionError(f"{router.topk_key}={topk} is more than the {experts} experts ({key}): "
                              "a token cannot be routed to more experts than there are")
    renormalise = True if router.renormalise_key is None else bool(cfg.get(router.renormalise_key, False))
    aux = cfg.get(router.aux_loss_key) or 0.0
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0.0 <= aux < float("inf"):
        raise ConversionError(f"config.json has {router.aux_loss_key}={aux!r}; expected a finite number >= 0")
    shared = positive(cfg, router.shared_ffn_key) if router.shared_ffn_key else 0
    layers = router.layers(cfg) if router.layers else None
    fields = MoeFields(experts, topk, positive(cfg, router.ffn_key), renormalise, float(aux), shared,
                       router.shared_expert_gate, None if layers is None or "0" not in layers else layers)
    return replace(fields, **router.read(cfg)) if router.read else fields


def positive(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if type(value) is not int or value < 1:
        raise ConversionError(f"config.json has {key}={value!r}; a Mixture-of-Experts model needs a positive integer")
    return value
