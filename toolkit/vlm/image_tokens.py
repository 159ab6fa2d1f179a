"""The image tokens of a batch, and the visual rows placed at them in the order transformers places them.

HF's Qwen3VLModel fills `inputs_embeds[input_ids == image_token_id]` ([b, s] row-major: the first sample's image
tokens first) with the tower's rows in order (masked_scatter), and DeepStack adds its rows at the same places
(_deepstack_process). megatron-core holds hidden states as [s, b, h], so the rows are placed through the [b, s]
view, never in [s, b] order (which would interleave the samples' images).
"""

from __future__ import annotations

import torch

from toolkit.train.data_sources import DataError


def image_token_mask(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[b, s]: True at the image tokens (HF's get_placeholder_mask for input ids)."""
    return input_ids == image_token_id


def rows_at_image_tokens(like_sbh: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """An [s, b, h] tensor of zeros but `rows` ([image tokens, h], batch order) at the mask's tokens."""
    if int(mask.sum()) != rows.shape[0]:
        raise DataError(f"{int(mask.sum())} image tokens in input_ids but {rows.shape[0]} image features from "
                        "pixel_values and image_grid_thw: pass the processor's outputs for the same conversations")
    placed = torch.zeros_like(like_sbh.transpose(0, 1)).masked_scatter(mask[..., None].to(like_sbh.device),
                                                                       rows.to(like_sbh.dtype))
    return placed.transpose(0, 1).contiguous()  # as megatron-core's hidden states are (its p2p sends need it)


def place_image_embeds(embeds_sbh: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The decoder's input embeddings ([s, b, h]) with the image tokens' replaced by the tower's rows."""
    at_images = mask.transpose(0, 1).contiguous()[..., None].to(embeds_sbh.device)
    return torch.where(at_images, rows_at_image_tokens(embeds_sbh, mask, rows), embeds_sbh)
