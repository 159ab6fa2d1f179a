"""Tokens routed to each expert of each layer during a training step (the load balance), for the
metrics: counted by a forward hook on every megatron-core router, padding left out, summed over
the ranks that see distinct tokens (DP, and TP under sequence parallelism) and over the stages."""

from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertLoad:
    def __init__(self, model, num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.shape = (num_layers, num_experts)
        self.counts = None  # on the compute device, made at the first count (no host sync per layer)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._count)

    def _count(self, router, inputs, output) -> None:
        if not router.training:
            return
        routing_map = output[1]  # [tokens, experts], True where a token goes
        padding = inputs[1] if len(inputs) > 1 else None  # [s, b] from MoELayer.route, True at padding
        if padding is not None:
            routing_map = routing_map & ~padding.reshape(-1, 1)
        if self.counts is None:
            self.counts = torch.zeros(self.shape, dtype=torch.float64, device=routing_map.device)
        self.counts[router.layer_number - 1] += routing_map.sum(0).double()  # global layer number, 1-based

    def take(self, device) -> list[list[int]]:
        """The step's counts over every rank (collective), then reset."""
        from megatron.core import parallel_state as ps

        total = torch.zeros(self.shape, dtype=torch.float64, device=device) if self.counts is None else self.counts.clone()
        # over DP x CP: under context parallelism each CP rank routes its chunks of the sequence
        groups = [ps.get_data_parallel_group(with_context_parallel=True), ps.get_pipeline_model_parallel_group()]
        if ps.get_tensor_model_parallel_world_size() > 1:  # MoE with TP runs sequence-parallel: distinct tokens
            groups.append(ps.get_tensor_model_parallel_group())
        for group in groups:
            dist.all_reduce(total, group=group)
        self.reset()
        return [[int(n) for n in layer] for layer in total.tolist()]

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()
