"""The image tokens of a batch, and the visual rows placed at them in the order transformers places them.

HF's Qwen3VLModel fills `inputs_embeds[input_ids == image_token_id]` ([b, s] row-major: the first sample's image
tokens first) with the tower's rows in order (masked_scatter), and DeepStack adds its rows at the same places
(_deepstack_process). megatron-core holds hidden states as [s, b, h], so the rows are placed through the [b, s]
view, never in [s, b] order (which would interleave the samples' images). Under sequence parallelism each TP rank
holds a chunk of the sequence: the placed rows are cut to this rank's chunk by megatron-core's
scatter_to_sequence_parallel_region, whose backward all-gathers, so every TP rank's tower gets the whole gradient.
"""

from __future__ import annotations

import torch

from toolkit.train.data_sources import DataError


def image_token_mask(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[b, s]: True at the image tokens (HF's get_placeholder_mask for input ids)."""
    return input_ids == image_token_id


def _this_ranks_tokens(sbh: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[s, b, ...] as this rank holds it: whole, or its chunk of the sequence under sequence parallelism."""
    if not sequence_parallel:
        return sbh
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(sbh)


def rows_at_image_tokens(mask: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype,
                         sequence_parallel: bool = False) -> torch.Tensor:
    """An [s, b, h] tensor (this rank's tokens of it) of zeros but `rows` ([image tokens, h], batch order) at the
    mask's tokens."""
    if int(mask.sum()) != rows.shape[0]:
        raise DataError(f"{int(mask.sum())} image tokens in input_ids but {rows.shape[0]} image features from "
                        "pixel_values and image_grid_thw: pass the processor's outputs for the same conversations")
    rows = rows.to(dtype)
    placed = rows.new_zeros(*mask.shape, rows.shape[-1]).masked_scatter(mask[..., None].to(rows.device), rows)
    # contiguous, as megatron-core's hidden states are (its pipeline's sends need it)
    return _this_ranks_tokens(placed.transpose(0, 1).contiguous(), sequence_parallel)


def place_image_embeds(embeds_sbh: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """The decoder's input embeddings ([s, b, h], this rank's tokens) with the image tokens' replaced by the rows."""
    at_images = _this_ranks_tokens(mask.transpose(0, 1).contiguous(), sequence_parallel)[..., None]
    placed = rows_at_image_tokens(mask, rows, embeds_sbh.dtype, sequence_parallel)
    return torch.where(at_images.to(embeds_sbh.device), placed, embeds_sbh)
