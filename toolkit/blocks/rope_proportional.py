"""Gemma 4's global-layer RoPE (transformers' "proportional" rope type): part of each head rotated, with
the frequencies of the whole head; its layers build a RotaryEmbedding and replace its inv_freq by these
(toolkit/blocks/attention_self.py Gemma4SelfAttention)."""

from __future__ import annotations

import torch


def proportional_inv_freq(head_dim: int, base: float, partial: float, device=None) -> torch.Tensor:
    """Gemma 4's global-layer RoPE frequencies (transformers' "proportional" rope type): for the first
    int(partial * head_dim / 2) pairs base ** (-2i / head_dim), the exponent over the whole head; 0 for
    the rest, whose dimensions then pass through (cos 1, sin 0)."""
    angles = int(partial * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)])
