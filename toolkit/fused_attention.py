"""The local spec's core attention, computed by torch's fused `scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` runs attention unfused: a baddbmm for the scores, a
masked fill, a softmax and a bmm, each materialising the [b·heads, s, s] scores. On CPU that was a
third of our step-time gap to an HF model (which uses SDPA) under plain DeepSpeed
(benchmarks/finetune_bench.py). On GPUs the Transformer Engine spec replaces the whole module, so
this only changes the local (CPU, or GPU without TE) path.

`SdpaAttention` takes the same inputs and gives the same output as `DotProductAttention` (it is a
subclass, so its settings, checks and checkpoint keys are megatron-core's). It falls back to the
unfused path for what it does not express: a sliding window, attention dropout, a softmax with an
offset, an attention bias or packed sequences.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    def _unfused_only(self, attention_bias, packed_seq_params) -> bool:
        return (self.scale_mask_softmax.window_size is not None
                or (self.training and self.attention_dropout.p > 0)
                or self.softmax_offset is not None
                or attention_bias is not None
                or packed_seq_params is not None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self._unfused_only(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        # [s, b, heads, head_dim] -> [b, heads, s, head_dim]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = query.size(1) // key.size(1)
        if groups > 1:  # grouped-query attention: each KV head serves `groups` query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        # megatron-core's mask is True where a position is masked out, SDPA's where it takes part
        keep = None if attention_mask is None else ~attention_mask
        # apply_query_key_layer_scaling divides the score scale by the layer number and the softmax
        # multiplies it back (its `scale`); the product is the scale that applies
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        context = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep,
                                                                   is_causal=causal, scale=scale)
        # [b, heads, s, head_dim] -> [s, b, heads * head_dim]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)


def with_fused_attention(layer_spec):
    """`layer_spec` (a megatron-core ModuleSpec of a decoder layer) with SdpaAttention as its core
    attention, where it has megatron-core's local DotProductAttention."""
    from dataclasses import replace

    attention = getattr(layer_spec.submodules, "self_attention", None)
    if attention is None or getattr(attention.submodules, "core_attention", None) is not DotProductAttention:
        return layer_spec
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=SdpaAttention))
    return replace(layer_spec, submodules=replace(layer_spec.submodules, self_attention=attention))
