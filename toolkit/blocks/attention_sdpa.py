"""The local layer spec's core attention through torch's fused scaled_dot_product_attention (SDPA).

megatron-core's local DotProductAttention (dot_product_attention.py) computes attention in three
steps: baddbmm into a [b·heads, s, s] score buffer, a torch softmax in float32 (its fused softmax
kernels come from Apex or Transformer Engine), then bmm. Without Transformer Engine (the GPU image
we target has none) every layer writes and reads those s² scores: on an H200 at sequence 2048 the
1B fine-tune ran 1.46x slower than HF + DeepSpeed, whose attention is SDPA (docs/gpu_suite.md), and
held 34.5 GB where HF held 22.8 GB.

`SdpaAttention` is that DotProductAttention with its forward through
torch.nn.functional.scaled_dot_product_attention, which picks the flash or memory-efficient kernel
on CUDA and never materialises the scores there. Same inputs and outputs ([s, b, heads, dim] in,
[s, b, heads·dim] out), same softmax scale, same masks: causal; megatron-core's convention for a
given mask (True = masked out, used as given); a sliding window (`window_size`, megatron-core's
(left, 0)) as a mask, together with a given one (the packed rows' documents), where
DotProductAttention's softmax replaces a given mask by the window's (fused_softmax.py:321-322).

The cases SDPA has no place for are left to DotProductAttention, whose results they are:
attention sinks (softmax_offset), query-key layer scaling, attention dropout while training, a
query shorter than the keys without a mask (a KV cache), attention bias and packed_seq_params
(which DotProductAttention refuses itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def window_causal_mask(seq_len: int, window: tuple[int, int] | None, device) -> torch.Tensor:
    """[s, s] True where masked: a key after its query, or (with megatron-core's window (left, 0))
    more than `left` keys before it."""
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]
    masked = distance < 0
    if window is not None:
        masked |= distance > window[0]
    return masked


class SdpaAttention(DotProductAttention):
    """DotProductAttention computed by torch's scaled_dot_product_attention (module docstring)."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        # the window DotProductAttention's softmax applies on this layer (None on full-attention layers)
        self.window = self.scale_mask_softmax.window_size
        self._window_mask = None  # (sequence length, device, mask): the same for every micro-batch

    def sdpa_applies(self, query, key, attention_mask, attention_bias, packed_seq_params) -> bool:
        # queries and keys of different lengths: a given mask says which pairs count (context parallelism's
        # queries over the gathered keys); without one (a KV cache) DotProductAttention decides
        lengths = query.shape[0] == key.shape[0] or (attention_mask is not None and self.window is None)
        return (lengths and self.softmax_offset is None and not self.config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0)
                and attention_bias is None and packed_seq_params is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self.sdpa_applies(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        masked = self._masked(query.shape[0], query.device, attention_mask)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: each K/V head serves `groups` query heads, as DotProductAttention
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, dim] -> [b, heads, s, dim]
        causal = masked is None and self.attn_mask_type == AttnMaskType.causal and query.shape[0] > 1
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked,
                                                 is_causal=causal, scale=self.softmax_scale)
        # [b, heads, s, dim] -> [s, b, heads·dim]
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _masked(self, seq_len: int, device, attention_mask):
        """The mask (True = masked) DotProductAttention's softmax would apply, or None for plain causal."""
        if self.window is None:
            return attention_mask
        if self._window_mask is None or self._window_mask[:2] != (seq_len, device):
            self._window_mask = (seq_len, device, window_causal_mask(seq_len, self.window, device))
        window = self._window_mask[2]
        return window if attention_mask is None else window | attention_mask


def with_sdpa_core_attention(spec):
    """A local-spec layer (ModuleSpec) or block (TransformerBlockSubmodules) with SdpaAttention as the
    core attention of every layer that has megatron-core's DotProductAttention."""
    from dataclasses import replace

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(spec, TransformerBlockSubmodules):
        return replace(spec, layer_specs=[with_sdpa_core_attention(layer) for layer in spec.layer_specs])
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if getattr(getattr(attention, "submodules", None), "core_attention", None) is not DotProductAttention:
        return spec  # Transformer Engine's, linear attention (none), MLA's own, or already replaced
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=SdpaAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))
