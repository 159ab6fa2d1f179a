"""LongRoPE (Phi-3.5-mini, Phi-4-mini, the Phi-3 128k models) as transformers 5.23 computes it, on
top of megatron-core 0.16.1, whose RotaryEmbedding has no per-frequency factors.

transformers (modeling_rope_utils.py `_compute_longrope_parameters`, `dynamic_rope_update`):
- inv_freq = 1 / (factors * theta ** (arange(0, dim, 2) / dim)), `factors` the config's
  short_factor, or its long_factor once the input is longer than original_max_position_embeddings:
  the choice is made per forward for the whole input, by max(position_ids) + 1, not per position;
- cos and sin are multiplied by an attention factor: the config's `attention_factor`, else
  sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 where factor <= 1), `factor` the
  config's or max_position_embeddings / original_max_position_embeddings.

Here GPTModel's rotary module is replaced by LongRopeEmbedding, which picks the factors by the
rotary sequence length megatron-core passes it (the input's length: positions 0..s-1, as HF's
max(position_ids) + 1 for the positions training feeds). The attention factor multiplies q's and
k's rotated dimensions before RoPE, in the q / k norm slots SelfAttention calls first
(attention.py get_query_key_value_tensors): RoPE is linear in q, so rope(a * q) = a * rope(q),
which is HF's q * (a * cos) + rotate_half(q) * (a * sin); megatron-core's own mscale argument is
only reachable through YaRN's config fields (attention.py:1102).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from toolkit.families.longrope import ORIGINAL_MAX


def inverse_frequencies(factors: list[float], theta: float, dim: int, device=None) -> torch.Tensor:
    """HF's operations in HF's order, so the frequencies are the same floats."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta**exponents)


class LongRopeEmbedding(RotaryEmbedding):
    """GPTModel's rotary module with the short factors up to `original_max_position_embeddings`
    tokens and the long ones past it."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_base: float, longrope: dict,
                 use_cpu_initialization: bool = False):
        super().__init__(kv_channels=kv_channels, rotary_percent=rotary_percent, rotary_base=rotary_base,
                         use_cpu_initialization=use_cpu_initialization)
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        device = self.inv_freq.device
        self.inv_freq = inverse_frequencies(longrope["short_factor"], rotary_base, dim, device)
        self.long_inv_freq = inverse_frequencies(longrope["long_factor"], rotary_base, dim, device)
        self.original_max_positions = longrope[ORIGINAL_MAX]

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        long = max_seq_len + offset > self.original_max_positions
        inv_freq = self.long_inv_freq.to(self.inv_freq.device) if long else self.inv_freq
        return torch.outer(positions, inv_freq)


class RotaryScale(torch.nn.Module):
    """Multiplies the first `rotary_dim` dimensions of each head ([..., heads, head_dim]) by the
    attention factor; the unrotated rest passes through, as HF scales only cos and sin."""

    def __init__(self, factor: float, rotary_dim: int):
        super().__init__()
        self.factor, self.rotary_dim = factor, rotary_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotated, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rotated * self.factor, rest), dim=-1)


def install_longrope(model, spec, use_cpu_initialization: bool) -> None:
    """Replace a built GPTModel's rotary module, and put the attention factor in each of this
    stage's layers (whose q / k norm slots must be empty: no LongRoPE family has q / k norms)."""
    from megatron.core.transformer.identity_op import IdentityOp

    model.rotary_pos_emb = LongRopeEmbedding(spec.head_dim, spec.rotary_percent, spec.rope_theta, spec.longrope,
                                             use_cpu_initialization)
    for layer in model.decoder.layers:
        attention = layer.self_attention
        for slot in ("q_layernorm", "k_layernorm"):
            if not isinstance(getattr(attention, slot), (IdentityOp, type(None))):
                raise NotImplementedError("LongRoPE with q / k norms")
            setattr(attention, slot, RotaryScale(spec.longrope["attention_factor"], spec.rotary_dim))
