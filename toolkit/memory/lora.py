"""What LoRA changes in the memory of a layout (toolkit.lora's layers, as DeepSpeed sees them).

* The base weights are frozen: DeepSpeed's ZeRO optimizers take only parameters that require a
  gradient, so the base keeps its weights in the training dtype and nothing else (no gradient,
  no fp32 master, no Adam state). ZeRO-3 still partitions it and gathers it layer by layer.
* The adapter is what trains: its tensors get the full-fine-tuning treatment of
  toolkit.memory.states (gradients, fp32 master where mixed precision, Adam states).
* Activations: megatron-core's linears run a frozen weight through LinearWithFrozenWeight,
  which keeps no input, so a linear keeps its input only where LoRA's A needs it (once per
  linear, however many of its targets are adapted); each adapted target also keeps its A x
  (r wide) for B's gradient, and dropout before A adds its output and its mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.families import family_named
from toolkit.families.spec import ModelSpec
from toolkit.lora import targets

BOOL = 1


@dataclass(frozen=True)
class LoraShape:
    """The LoRA settings that change memory: rank, PEFT target names, dropout."""

    r: int
    target_modules: tuple[str, ...] = (targets.ALL_LINEAR,)
    dropout: float = 0.0

    def linears(self, spec: ModelSpec) -> list[targets.LinearTargets]:
        """The adapted linears; refuses a name the family lacks and an r out of range."""
        if spec.is_moe:  # the experts' adapters and the layer kinds are not counted here yet
            raise ConfigError(f"the memory of LoRA on a Mixture-of-Experts model ({spec.family}) is not estimated yet")
        linears = targets.resolve(family_named(spec.family), spec, list(self.target_modules))
        targets.check_rank(self.r, linears)
        return linears


@functools.lru_cache(maxsize=256)
def adapter_numels(spec: ModelSpec, lora: LoraShape, tp: int, pp: int) -> tuple[int, ...]:
    """Element count of every LoRA tensor on one TP rank of any pipeline stage: a column-parallel
    base gets A whole and B split along its output; a row-parallel one A split along its input and
    B whole (toolkit.lora.layers)."""
    per_layer = []
    for linear in lora.linears(spec):
        row = linear.parallel == targets.ROW
        for t in (t for t in linear.parts if t.name in linear.chosen):
            a, b = lora.r * t.in_features, t.out_features * lora.r
            per_layer += [a // tp, b] if row else [a, b // tp]
    return tuple(per_layer * (spec.num_layers // pp))


@functools.lru_cache(maxsize=256)
def activation_change(spec: ModelSpec, lora: LoraShape, tokens: int, tp: int, act_bytes: int) -> int:
    """Bytes one layer keeps for backward for one micro-batch, LoRA's minus full fine-tuning's
    (toolkit.memory.activations counts every linear's input as kept)."""
    adapted = {linear.row.megatron: linear for linear in lora.linears(spec)}
    change = 0
    for linear in targets.linear_rows(family_named(spec.family), spec):
        width = linear.parts[0].in_features // (tp if linear.parallel == targets.ROW else 1)
        if linear.row.megatron not in adapted:
            change -= act_bytes * tokens * width  # a frozen linear keeps no input
            continue
        change += act_bytes * tokens * lora.r * len(adapted[linear.row.megatron].chosen)  # A x, for B's gradient
        if lora.dropout > 0:
            change += (act_bytes + BOOL) * tokens * width  # dropout output (A's input) and its mask
    return change
