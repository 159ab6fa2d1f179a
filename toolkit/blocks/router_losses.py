"""The routers' load-balancing (auxiliary) loss: megatron-core's, or HF's, selected by `AuxLoss`.

E experts, top-k routing; for MoE layer l of L and the T tokens of one forward (one micro-batch),
c[l, i] is the number of tokens routed to expert i (top-k, so sum_i c[l, i] = k T) and
p[l, i] the sum over tokens of softmax(router logits)[i]. With the coefficient `coeff`:

- "megatron" (megatron-core's switch loss, transformer/moe/moe_utils.py switch_load_balancing_loss_func,
  one per layer, each attached to its router's output by MoEAuxLossAutoScaler):
      sum over l of  coeff * E / (k * T^2) * sum_i c[l, i] * p[l, i]
- "hf" (transformers' load_balancing_loss_func, models/mixtral/modeling_mixtral.py, the same in
  Qwen2-MoE, Qwen3-MoE and OLMoE; the causal-LM loss adds router_aux_loss_coef times it when
  output_router_logits): counts and probabilities pooled over all layers first,
      coeff * E / (L * T)^2 * sum_i (sum_l c[l, i]) * (sum_l p[l, i])
  which is no sum of per-layer terms: layer l's gradient depends on every layer's counts.

"hf" wraps each router's `routing` (transformer/moe/router.py:545): after it, the layer's counts and
probabilities go to the pool of the current forward, and the gradient is attached to the router's
output, as MoEAuxLossAutoScaler does, computed from the pool's final counts: backward runs after the
whole forward, when the pool is complete. That holds at PP = 1 only; at PP > 1 the layers live on
different stages, and no stage sees the others' counts before its backward, so "hf" is refused there. Tokens are those of
the router's input summed over the TP / CP group (sequence parallelism), as megatron-core counts them;
padding is left out where megatron-core is given a padding mask, as HF leaves it out given an
attention mask. Both modes scale the injected gradient by MoEAuxLossAutoScaler's
main_loss_backward_scale (set_loss_scale), which a trainer sets to its loss scale / micro-batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from toolkit.errors import ConfigError

MODES = ("megatron", "hf")


@dataclass(frozen=True)
class AuxLoss:
    mode: str = "megatron"
    coeff: float = 0.0  # 0: no load-balancing loss (HF: router_aux_loss_coef, applied with output_router_logits)

    def check(self, pp: int = 1) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"moe.aux_loss={self.mode!r}: choose one of {', '.join(MODES)}")
        if self.coeff < 0:
            raise ConfigError(f"moe.aux_loss_coeff={self.coeff!r}: must be >= 0")
        if self.mode == "hf" and pp > 1:
            raise ConfigError(f"moe.aux_loss=hf with PP={pp}: HF's loss pools router counts over all layers of a "
                              "forward, which at PP > 1 live on different pipeline stages; use moe.aux_loss=megatron")

    def config_fields(self) -> dict:
        """TransformerConfig fields: megatron-core's "aux_loss" load balancing with this coefficient;
        none of megatron-core's own in hf mode (install adds HF's)."""
        return {"moe_aux_loss_coeff": self.coeff if self.mode == "megatron" else 0.0,
                "moe_router_load_balancing_type": "aux_loss"}

    def install(self, model: torch.nn.Module) -> None:
        """In hf mode, pool the routers of `model` (one pipeline stage, the whole model at PP 1)."""
        if self.mode != "hf" or self.coeff == 0:
            return
        from megatron.core.transformer.moe.router import TopKRouter

        current = _Current()
        model.register_forward_pre_hook(lambda module, args: current.start())
        model.moe_aux_pool = current
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.routing = functools.partial(_pooled_routing, module, current, self.coeff, module.routing)


def last_aux_loss(model: torch.nn.Module) -> torch.Tensor:
    """hf mode: the load-balancing loss of the model's last forward, without the coefficient
    (HF's `outputs.aux_loss`)."""
    return model.moe_aux_pool.pool.value()


class _Pool:
    """One forward's router statistics per layer: (counts, probability sums, tokens). Keyed by layer,
    so a layer's forward recomputed in backward (activation recomputation) replaces its own entry."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}

    def add(self, layer: int, counts: torch.Tensor, probs: torch.Tensor, tokens) -> None:
        self.layers[layer] = (counts, probs, tokens)

    def _totals(self):
        counts, probs, tokens = zip(*self.layers.values())
        return sum(counts), sum(probs), sum(tokens)

    def value(self) -> torch.Tensor:
        counts, probs, tokens = self._totals()
        return counts.numel() * (counts * probs).sum() / tokens**2

    def probs_gradient(self, coeff: float) -> torch.Tensor:
        """d(coeff * value) / d(one token's probabilities): the same for every token."""
        counts, _, tokens = self._totals()
        return coeff * counts.numel() * counts / tokens**2


class _Current:
    def __init__(self):
        self.pool = _Pool()

    def start(self) -> None:
        self.pool = _Pool()  # a new object: a backward still pending holds its own forward's pool


class _PooledGradient(torch.autograd.Function):
    """Passes `probs` through; in backward, gives `scores` the pooled loss's gradient (complete by then)."""

    @staticmethod
    def forward(ctx, probs, scores, pool, coeff):
        ctx.pool, ctx.coeff, ctx.shape, ctx.dtype = pool, coeff, scores.shape, scores.dtype
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        grad = ctx.pool.probs_gradient(ctx.coeff).to(ctx.dtype).expand(ctx.shape)
        return grad_probs, grad if scale is None else grad * scale, None, None


def _pooled_routing(router, current: _Current, coeff: float, routing, logits, padding_mask=None):
    """TopKRouter.routing, then this layer's counts and probabilities into the pool, counted as
    megatron-core counts them for its own loss (router.py:598-611, 275-313). Pooled in any grad mode:
    under activation recomputation the first forward runs without grad and must still count."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         get_tokens_per_expert_and_token_count)

    probs, routing_map = routing(logits, padding_mask=padding_mask)
    if not router.training:
        return probs, routing_map
    mask = None if padding_mask is None else padding_mask.reshape(-1)
    aux_map, scores = compute_routing_scores_for_aux_loss(logits.view(-1, router.config.num_moe_experts), router.topk,
                                                          router.score_function, padding_mask=mask)
    counts, _, total_tokens = get_tokens_per_expert_and_token_count(
        routing_map=aux_map, reduce_group=router.tp_cp_group, topk=router.topk, with_padding_mask=mask is not None)
    probs_sum = reduce_from_tensor_model_parallel_region(scores.detach().sum(0), router.tp_cp_group)
    current.pool.add(router.layer_number, counts.float(), probs_sum.float(), total_tokens)
    if torch.is_grad_enabled():
        probs = _PooledGradient.apply(probs, scores, current.pool, coeff)
    return probs, routing_map
