"""Qwen3-VL's vision tower: transformers' own Qwen3VLVisionModel, loaded from the wrapper checkpoint's tensors.

The tower (patch embedding, learned position grid, blocks, the 2 x 2 patch merger, the DeepStack mergers) is
HF's module itself, run as it is on the first pipeline stage, replicated on each of its TP ranks: its input
(pixels) and its output gradient (the decoder's input-embedding gradient, all-reduced over TP by the first
column-parallel linear) are the same on every TP rank, so each rank computes the same tower gradient; no TP
split of the tower yet. It costs its parameters (and their optimizer state) once per first-stage GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.convert.wrapper import open_wrapper
from toolkit.errors import ConversionError

# Where each vision-language wrapper keeps its vision tower's tensors, and transformers' class of the tower
TOWERS = {"qwen3_vl": ("model.visual.", "Qwen3VLVisionModel")}


@dataclass
class VisualFeatures:
    """The tower's output for a batch's images, in batch order: one row per image token."""

    embeds: torch.Tensor  # [image tokens, hidden]: what replaces the image tokens' input embeddings
    deepstack: list[torch.Tensor]  # [image tokens, hidden] per DeepStack layer: added after decoder layer i


class VisionTower(torch.nn.Module):
    """HF's vision model; forward(pixel_values, image_grid_thw) -> VisualFeatures."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> VisualFeatures:
        out = self.model(pixel_values.to(self.model.dtype), grid_thw=image_grid_thw, return_dict=True)
        return VisualFeatures(out.pooler_output, list(out.deepstack_features))


def load_vision_tower(wrapper_dir: str | Path, dtype: torch.dtype = torch.float32) -> VisionTower:
    """The vision tower of a wrapper checkpoint, built from its config (transformers' config class) and loaded
    from its tensors; refused in one line for a wrapper without a tower the toolkit runs."""
    import transformers

    view = open_wrapper(wrapper_dir)
    model_type = view.wrapper.model_type
    if model_type not in TOWERS:
        raise ConversionError(f"{wrapper_dir}: the vision tower of a {model_type} checkpoint is carried, not run: "
                              f"images are read for {', '.join(TOWERS)} only")
    prefix, cls_name = TOWERS[model_type]
    vision_config = transformers.AutoConfig.from_pretrained(str(wrapper_dir)).vision_config
    model = getattr(transformers, cls_name)._from_config(vision_config, dtype=dtype)
    state = {name[len(prefix):]: view.whole.read(name) for name in view.other_tensors() if name.startswith(prefix)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConversionError(f"{wrapper_dir}: the vision tower's tensors under {prefix}* do not fit {cls_name} "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    return VisionTower(model.to(dtype))
