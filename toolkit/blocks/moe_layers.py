"""Mixture-of-Experts layers and routers beyond megatron-core's own: Gemma 4's (enable_moe_block), its
MoE layer beside a dense MLP, each with norms of its own, and its scaled router. Built as classes on
first use (megatron-core's MoE modules are imported then), and given to the block spec
(toolkit/blocks/decoder_spec.py) as megatron-core's local MoE spec with these in place."""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.norms import RMSNorm, ValueNorm


def _gemma4_moe_classes():
    """Gemma 4's MoE block (enable_moe_block) as megatron-core's MoE layer with what HF adds around it."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    class Gemma4Router(TopKRouter):
        """Gemma4TextRouter: logits of rms(x) * scale / sqrt(hidden) (x the layer's FFN input, before any norm:
        `routed_input`, set by the MoE layer), softmax top-k renormalised (megatron-core's top-k then softmax),
        then each chosen weight times its expert's per_expert_scale."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype, device=device))
            self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype,
                                                                  device=device))
            for param in (self.scale, self.per_expert_scale):  # summed over TP as the router's weight (router.py:82)
                param.sequence_parallel = config.sequence_parallel
            self.unit_norm = ValueNorm(config.layernorm_epsilon)
            self.root = config.hidden_size ** -0.5
            self.routed_input = None

        def gating(self, input):
            x = self.routed_input if self.routed_input is not None else input
            return super().gating(self.unit_norm(x) * self.scale * self.root)

        def routing(self, logits, *args, **kwargs):
            probs, routing_map = super().routing(logits, *args, **kwargs)
            return probs * self.per_expert_scale.to(probs.dtype), routing_map

    class Gemma4MoELayer(MoELayer):
        """Gemma4TextDecoderLayer's feed-forward half with enable_moe_block, on the layer's residual stream x
        (its pre-MLP norm the identity): post_norm(dense_post_norm(dense(dense_norm(x))) +
        experts_post_norm(experts(experts_norm(x)))), the router reading x itself."""

        def __init__(self, config, submodules=None, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                   linear_fc2=RowParallelLinear))
            self.dense = build_module(dense, config=config)
            eps = config.layernorm_epsilon
            self.dense_norm, self.dense_post_norm = RMSNorm(config, config.hidden_size, eps), RMSNorm(config, config.hidden_size, eps)
            self.experts_norm, self.experts_post_norm = (RMSNorm(config, config.hidden_size, eps),
                                                         RMSNorm(config, config.hidden_size, eps))
            self.post_norm = RMSNorm(config, config.hidden_size, eps)

        def forward(self, hidden_states, *args, **kwargs):
            dense, _ = self.dense(self.dense_norm(hidden_states))
            self.router.routed_input = hidden_states
            try:
                experts, bias = super().forward(self.experts_norm(hidden_states), *args, **kwargs)
            finally:
                self.router.routed_input = None
            return self.post_norm(self.dense_post_norm(dense) + self.experts_post_norm(experts)), bias

    return Gemma4Router, Gemma4MoELayer


_GEMMA4_MOE = None


def gemma4_moe_spec(config):
    """megatron-core's local MoE spec with Gemma 4's layer and router (a partial from 0.17, a ModuleSpec before)."""
    from dataclasses import replace

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    global _GEMMA4_MOE
    _GEMMA4_MOE = _GEMMA4_MOE or _gemma4_moe_classes()
    router, layer = _GEMMA4_MOE
    base = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if isinstance(base, ModuleSpec):
        return ModuleSpec(module=layer, submodules=replace(base.submodules, router=router), params=base.params)
    return functools.partial(layer, *base.args, **{**base.keywords, "submodules": replace(base.keywords["submodules"],
                                                                                          router=router)})
