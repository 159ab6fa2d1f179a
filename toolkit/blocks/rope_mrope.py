"""Qwen3-VL's interleaved multimodal RoPE (MRoPE), as transformers 5.24's Qwen3VLTextRotaryEmbedding computes it.

Each token has three positions (T, H, W: toolkit/vlm/positions.py). HF takes the angle of frequency j from one
stream: H's where j % 3 == 1 and j < 3 * mrope_section[1], W's where j % 3 == 2 and j < 3 * mrope_section[2],
T's everywhere else (recomposition_frequencies), then rotates half as plain RoPE does. megatron-core 0.19.2's
MultimodalRotaryEmbedding (Qwen2-VL's) takes them in contiguous chunks instead, T's first mrope_section[0]
frequencies, H's the next, W's the rest (`emb.split(mrope_section * 2)`, `m[i % 3]`): the same angles in other
slots, another model (and its inv_freq is made on torch.cuda.current_device()). Here GPTModel's rotary module
is replaced by one with that module's interface, forward(position_ids [3, b, s], mrope_section) ->
[s, b, 1, head_dim], which GPTModel._preprocess calls with the position ids it is given once its
position_embedding_type is 'mrope'; megatron-core's attention takes the cos and sin of these angles.

The angles are HF's floats: each position as float32 times HF's inverse frequency, the same product.
"""

from __future__ import annotations

import torch

STREAMS = 3  # T, H, W


def interleaved_streams(mrope_section: list[int], frequencies: int) -> torch.Tensor:
    """For each of the `frequencies` rotary frequencies, the stream (0 T, 1 H, 2 W) its angle comes from."""
    index = torch.arange(frequencies)
    streams = torch.zeros(frequencies, dtype=torch.long)
    for stream in (1, 2):
        streams[(index % STREAMS == stream) & (index < STREAMS * mrope_section[stream])] = stream
    return streams


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """HF's default RoPE frequencies (compute_default_rope_parameters), in its order of operations."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


class InterleavedMRoPE(torch.nn.Module):
    """GPTModel's rotary module for Qwen3-VL: each token's angles from its (T, H, W) positions."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], device=None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, device), persistent=False)
        self.register_buffer("streams", interleaved_streams(mrope_section, head_dim // 2).to(device),
                             persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("Qwen3-VL's MRoPE under context parallelism")
        angles = position_ids.to(self.inv_freq.device)[..., None].float() * self.inv_freq  # [3, b, s, dim / 2]
        picked = angles.gather(0, self.streams.expand_as(angles[:1]))[0]  # [b, s, dim / 2]
        return torch.cat((picked, picked), dim=-1).transpose(0, 1)[:, :, None, :].contiguous()


def install_interleaved_mrope(model, head_dim: int, theta: float, mrope_section: list[int]) -> None:
    """Make a built GPTModel (any pipeline stage) take [3, b, s] position ids through InterleavedMRoPE."""
    model.rotary_pos_emb = InterleavedMRoPE(head_dim, theta, mrope_section, next(model.parameters()).device)
    model.position_embedding_type = "mrope"  # GPTModel._preprocess then passes it the position ids
    model.mrope_section = list(mrope_section)
