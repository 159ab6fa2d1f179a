"""LoRA wrappers around megatron-core's tensor-parallel linears: y = base(x) + s * B A dropout(x).

Column-parallel base (linear_qkv, linear_fc1): x is whole on every TP rank. Each target's A is
replicated, its B holds the output rows this rank's base holds, added at the same positions
(toolkit.lora.shards). Every rank's B sees only its rows of the output gradient, so the gradient
of A x is summed over TP (copy_to_tensor_model_parallel_region) before it reaches A and x.

Row-parallel base (linear_proj, linear_fc2): x is split along its features. A holds the matching
columns, so each rank computes part of A x; the parts are summed over TP
(reduce_from_tensor_model_parallel_region) and the replicated B maps the sum, which equals the
unsplit layer's B A x on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mark_split(param: torch.nn.Parameter, dim: int) -> None:
    """The attributes megatron-core sets on its own split weights: DeepSpeed's gradient norm counts
    a parameter without them on TP rank 0 only (a replica), with them on every rank (a shard)."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


class LoraLinear(torch.nn.Module):
    """A base linear (frozen) plus one LoRA pair (A, B) per target module inside it."""

    def __init__(self, base, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], scaling: float, dropout: float):
        super().__init__()
        self.base = base
        self.targets = tuple(a)  # their order (ParameterDict sorts the keys of a plain dict)
        self.lora_A = torch.nn.ParameterDict({name: torch.nn.Parameter(t) for name, t in a.items()})
        self.lora_B = torch.nn.ParameterDict({name: torch.nn.Parameter(t) for name, t in b.items()})
        self.scaling = scaling
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    def __getattr__(self, name):
        """megatron-core reads attributes of its linears (config, sequence_parallel, ...): the base's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x, *args, **kwargs):
        post_norm = getattr(self.base, "post_layernorm", None)
        if post_norm is not None:  # Gemma 3 / OLMo 2 (toolkit/layers.py): the delta enters before the norm
            return post_norm(self.add_delta(self.base.forward_before_norm(x), self.dropout(x))), None
        out, bias = self.base(x, *args, **kwargs)
        return self.add_delta(out, self.dropout(x)), bias

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelLora(LoraLinear):
    def __init__(self, base, a, b, positions: dict[str, torch.Tensor], scaling, dropout):
        super().__init__(base, a, b, scaling, dropout)
        for name in self.targets:
            mark_split(self.lora_B[name], 0)
        # The base's output rows each target's B rows land on, in the order of the targets.
        self.register_buffer("positions", torch.cat([positions[name] for name in self.targets]), persistent=False)

    def add_delta(self, out, x):
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        deltas = [F.linear(copy_to_tensor_model_parallel_region(F.linear(x, self.lora_A[name])), self.lora_B[name])
                  for name in self.targets]
        delta = torch.cat(deltas, dim=-1) * self.scaling
        return out.index_add(-1, self.positions.to(out.device), delta.to(out.dtype))


class RowParallelLora(LoraLinear):
    def __init__(self, base, a, b, scaling, dropout):
        super().__init__(base, a, b, scaling, dropout)
        for name in self.targets:
            mark_split(self.lora_A[name], 1)

    def add_delta(self, out, x):
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        for name in self.targets:
            u = reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A[name]))
            out = out + (F.linear(u, self.lora_B[name]) * self.scaling).to(out.dtype)
        return out
