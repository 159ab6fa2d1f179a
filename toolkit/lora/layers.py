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

import contextlib

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
        # method=dpo's reference pass (`as_reference`): the base alone, or with the adapter it started from
        self.reference_mode = False
        self.starting: tuple[dict, dict] | None = None

    def weights(self) -> tuple[dict, dict]:
        """(A, B) by target: the trained adapter, or in the reference pass the frozen starting one."""
        if self.reference_mode and self.starting is not None:
            return self.starting
        return self.lora_A, self.lora_B

    def __getattr__(self, name):
        """megatron-core reads attributes of its linears (config, sequence_parallel, ...): the base's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x, *args, **kwargs):
        if self.reference_mode and self.starting is None:  # the adapter disabled: the base model
            return self.base(x, *args, **kwargs)
        post_norm = getattr(self.base, "post_layernorm", None)
        if post_norm is not None:  # Gemma 3 / OLMo 2 (toolkit/blocks/linears.py): the delta enters before the norm
            return post_norm(self.add_delta(self.base.forward_before_norm(x), self.dropout(x))), None
        if getattr(self.base, "keys_as_values", False):  # Gemma 4's global linear_qkv: the delta on [q; k], then v = k
            out, bias = self.base.forward_qk(x, *args, **kwargs)
            return self.base.repeat_keys(self.add_delta(out, self.dropout(x))), bias
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

        a, b = self.weights()
        deltas = [F.linear(copy_to_tensor_model_parallel_region(F.linear(x, a[name])), b[name]) for name in self.targets]
        delta = torch.cat(deltas, dim=-1) * self.scaling
        return out.index_add(-1, self.positions.to(out.device), delta.to(out.dtype))


class RowParallelLora(LoraLinear):
    def __init__(self, base, a, b, scaling, dropout):
        super().__init__(base, a, b, scaling, dropout)
        for name in self.targets:
            mark_split(self.lora_A[name], 1)

    def add_delta(self, out, x):
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        a, b = self.weights()
        for name in self.targets:
            u = reduce_from_tensor_model_parallel_region(F.linear(x, a[name]))
            out = out + (F.linear(u, b[name]) * self.scaling).to(out.dtype)
        return out


def keep_starting_adapter(model) -> None:
    """Frozen copies of every LoRA pair as it starts (an adapter from peft.init_from): method=dpo's
    reference is the model with it, as TRL copies a loaded adapter to a "ref" adapter. Before
    DeepSpeed partitions the parameters; the copies are small (the adapter's size)."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.starting = tuple({n: p.detach().clone() for n, p in d.items()} for d in (module.lora_A, module.lora_B))


@contextlib.contextmanager
def as_reference(model):
    """The model as method=dpo's reference: each LoRA linear without its adapter (TRL with a new
    adapter: adapters disabled), or with its frozen starting adapter (keep_starting_adapter)."""
    wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for m in wrapped:
        m.reference_mode = True
    try:
        yield
    finally:
        for m in wrapped:
            m.reference_mode = False
