"""Qwen3-VL's 3-D positions (T, H, W) of each token, from the images' patch grids, as transformers 5.24's
Qwen3VLModel.get_rope_index computes them for images (tests/test_vlm_model.py compares the two).

Walking a sample's tokens in runs of one kind (the processor's mm_token_type_ids: 0 text, 1 image):
- a text run of n tokens takes the next n positions on all three streams;
- an image run is the next image of image_grid_thw, its (t, h, w) patches merged m x m
  (vision_config.spatial_merge_size) into t x h/m x w/m tokens in raster order: token (i, j, k) at
  (p + i, p + j, p + k) from the run's first position p; the position then moves on by max(h, w) / m, not by the
  run's length, so the text after an image continues from the image's extent.
Padding (attention_mask 0) is skipped and left at 0. Videos (type 2) are not read yet.
"""

from __future__ import annotations

import torch

from toolkit.train.data_sources import DataError

TEXT, IMAGE = 0, 1


def runs(kinds: list[int]) -> list[tuple[int, int, int]]:
    """(kind, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            out.append((kinds[start], start, i))
            start = i
    return out


def image_positions(grid: list[int], merge: int, start: int) -> torch.Tensor:
    """[3, t * h/m * w/m] positions of one image's tokens, its first at `start`."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack((ti, hi, wi)).reshape(3, -1) + start


def sample_positions(kinds: list[int], grids, merge: int) -> torch.Tensor:
    """[3, len(kinds)] positions of one sample's tokens; `grids` yields its images' (t, h, w) in order."""
    pieces, position = [], 0
    for kind, start, end in runs(kinds):
        length = end - start
        if kind == TEXT:
            pieces.append(torch.arange(position, position + length).expand(3, -1))
            position += length
        elif kind == IMAGE:
            grid = next(grids, None)
            tokens = None if grid is None else grid[0] * (grid[1] // merge) * (grid[2] // merge)
            if tokens != length:
                raise DataError(f"a run of {length} image tokens where image_grid_thw gives "
                                f"{'no image' if grid is None else f'{grid} ({tokens} tokens)'}: pass the processor's "
                                "input_ids, mm_token_type_ids and image_grid_thw together")
            pieces.append(image_positions(grid, merge, position))
            position += max(grid[1], grid[2]) // merge
        else:
            raise DataError(f"mm_token_type_ids {kind}: only text (0) and images (1) are read, not videos")
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def mrope_position_ids(token_types: torch.Tensor, image_grid_thw: torch.Tensor | None, spatial_merge_size: int,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[3, b, s] positions of a batch: [b, s] token types, its images' [n, 3] grids in batch order."""
    grids = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    out = torch.zeros(3, *token_types.shape, dtype=torch.long)
    for b, kinds in enumerate(token_types.cpu()):
        kept = (attention_mask[b].cpu().bool() if attention_mask is not None
                else torch.ones_like(kinds, dtype=torch.bool))
        out[:, b, kept] = sample_positions(kinds[kept].tolist(), grids, spatial_merge_size)
    if next(grids, None) is not None:
        raise DataError(f"image_grid_thw holds {len(image_grid_thw)} images, more than the batch's image tokens take")
    return out.to(token_types.device)
