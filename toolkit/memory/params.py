"""Which parameter tensors one rank holds, from the family's mapping table (the same rows the
converter uses), so the count is exact for every TP x PP layout."""

from __future__ import annotations

import functools
import math

from toolkit.families import family_named
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout

EMBEDDING_PREFIX = "embedding."
# the final norm: decoder.final_layernorm in GPTModel, decoder.final_norm in the hybrid stack (Nemotron-H)
LAST_STAGE_PREFIXES = ("decoder.final_layernorm.", "decoder.final_norm.", "output_layer.")
# fp8_linears: the decoder layers' linear weights, the routed experts' included, that Transformer Engine
# runs in FP8 (the router, norms, embedding and output layer stay bf16: toolkit/fp8/local.py says why)
PARTS = ("all", "dense", "experts", "fp8_linears")
FP32_BYTES = 4
# megatron-core keeps local_tokens_per_expert beside each expert_bias, of its size and dtype
ROUTER_BUFFERS_PER_BIAS = 2


@functools.lru_cache(maxsize=4096)
def stage_param_numels(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1,
                       part: str = "all") -> tuple[int, ...]:
    """Element count of every parameter tensor on one TP (and EP) rank of pipeline stage `stage`;
    an expert row gives one tensor per local expert (num_experts / ep of them). `part`: "all",
    "experts" (the routed experts, which ZeRO partitions over the expert-data-parallel group) or
    "dense" (everything else, the router included, partitioned over all of DP) or "fp8_linears"."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}")
    family = family_named(spec.family)
    padded_vocab = Layout(tp, pp).padded_vocab(spec.vocab_size)
    first, last = stage == 0, stage == pp - 1
    numels: list[int] = []
    for row in family.rows_for(spec):
        if row.is_buffer or not _in_part(row, part):
            continue
        numel = sum(math.prod(padded_vocab if s == "vocab" else spec.size_of(s) for s in shape) for shape in row.shapes)
        if row.split.over_tp:
            numel //= tp
        if row.per_layer:
            layers = sum(row.on_layer(n, spec.moe_layers, spec.linear_layers) for n in Layout(tp, pp).stage_layers(spec, stage))
            numels += [numel] * layers * (spec.num_experts // ep if row.per_expert else 1)
        elif row.megatron.startswith(EMBEDDING_PREFIX):
            numels += [numel] * first
            # Tied embeddings with PP > 1: megatron-core keeps a copy on the last stage as its output layer.
            numels += [numel] * (spec.tied_embeddings and last and not first)
        elif row.megatron.startswith(LAST_STAGE_PREFIXES):
            numels += [numel] * last
    return tuple(numels)


def _in_part(row, part: str) -> bool:
    if part == "fp8_linears":
        return row.per_layer and ".linear_" in row.megatron and row.megatron.rsplit(".", 1)[-1] == "weight"
    return part == "all" or row.per_expert == (part == "experts")


def stage_active_numel(spec: ModelSpec, tp: int, pp: int, stage: int) -> int:
    """Parameter elements of pipeline stage `stage`, all its TP ranks together (the vocab padded for
    TP), that one token goes through: the dense tensors, and moe_topk of each MoE layer's routed
    experts (the matmul work per token)."""
    dense = sum(stage_param_numels(spec, tp, pp, stage, part="dense")) * tp
    if not spec.is_moe:
        return dense
    return dense + sum(stage_param_numels(spec, 1, pp, stage, part="experts")) // spec.num_experts * spec.moe_topk


@functools.lru_cache(maxsize=64)
def total_params(spec: ModelSpec) -> int:
    """Parameters of the whole model (true vocab, tied embeddings counted once), as HF's model has them:
    buffers (the sigmoid router's expert bias) are not parameters."""
    return _count(spec, spec.num_experts)


@functools.lru_cache(maxsize=64)
def active_params(spec: ModelSpec) -> int:
    """Parameters one token goes through: total_params with moe_topk of the routed experts in each
    Mixture-of-Experts layer (the router, shared experts and dense layers whole), as published
    "activated" sizes count them (DeepSeek-V3: 37B of 671B)."""
    return _count(spec, spec.moe_topk)


def _count(spec: ModelSpec, experts: int) -> int:
    total = 0
    for row in family_named(spec.family).rows_for(spec):
        if row.is_buffer:
            continue
        numel = sum(math.prod(spec.size_of(s) for s in shape) for shape in row.shapes)
        layers = sum(row.on_layer(n, spec.moe_layers, spec.linear_layers) for n in range(spec.num_layers)) if row.per_layer else 1
        total += numel * layers * (experts if row.per_expert else 1)
    return total


@functools.lru_cache(maxsize=4096)
def stage_buffer_bytes(spec: ModelSpec, pp: int, stage: int) -> int:
    """Bytes of the megatron-core buffers a rank of pipeline stage `stage` holds beside its parameters:
    the sigmoid router's expert bias (a float32 [experts] per MoE layer, on every TP and EP rank; no
    gradient, no optimizer state) and the float32 token counts megatron-core keeps beside it to
    update it (local_tokens_per_expert, router.py:163-180)."""
    layers = Layout(1, pp).stage_layers(spec, stage)
    return sum(FP32_BYTES * ROUTER_BUFFERS_PER_BIAS * spec.num_experts * sum(row.on_layer(n, spec.moe_layers, spec.linear_layers)
                                                                           for n in layers)
               for row in family_named(spec.family).rows_for(spec) if row.is_buffer)
