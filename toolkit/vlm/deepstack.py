"""Qwen3-VL's DeepStack: the tower's intermediate features added to the decoder's hidden states at the image
tokens, after each of the first len(vision_config.deepstack_visual_indexes) decoder layers (transformers 5.24's
Qwen3VLTextModel: after layer i, hidden[image tokens] += deepstack_visual_embeds[i]).

megatron-core's TransformerBlock has no such step, so each of those layers gets a forward hook that adds the
features of the forward in progress (`DeepStack.features`). The layers must all sit on the first pipeline stage,
where the tower runs (refused otherwise); each TP rank adds the rows of the tokens it holds (all of them, or its
chunk under sequence parallelism). Full activation recompute would re-run those layers after the forward's features are
cleared, so it is refused with DeepStack (selective recompute re-runs only the core attention, inside the layer).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from toolkit.errors import ConfigError
from toolkit.vlm.image_tokens import rows_at_image_tokens


class DeepStack:
    def __init__(self, gpt_model, layers: int, first_stage: bool):
        self.layers = layers
        self.sequence_parallel = gpt_model.config.sequence_parallel  # each TP rank adds its chunk's rows
        self.mask: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        held = [layer for layer in gpt_model.decoder.layers if layer.layer_number - 1 < layers]  # 1-based numbers
        if held and gpt_model.config.recompute_granularity == "full":
            raise ConfigError("DeepStack with full activation recompute: not yet (the recomputed layers would miss "
                              "the visual features); use parallel.recompute=selective or none")
        if (len(held) < layers) if first_stage else held:  # the features exist on the first stage only
            raise ConfigError(f"DeepStack adds visual features after the first {layers} decoder layers, which must all "
                              "be on the first pipeline stage (the vision tower's): use fewer pipeline stages")
        self.hooks = [layer.register_forward_hook(self._hook(layer.layer_number - 1)) for layer in held]

    @contextmanager
    def features(self, mask: torch.Tensor | None, rows: list[torch.Tensor]):
        """Add `rows` (one [image tokens, h] per DeepStack layer) at `mask`'s tokens during this forward."""
        if mask is not None and len(rows) != self.layers:
            raise ConfigError(f"{len(rows)} DeepStack features for {self.layers} DeepStack layers")
        self.mask, self.rows = mask, rows
        try:
            yield
        finally:
            self.mask, self.rows = None, []

    def _hook(self, index: int):
        def add(module, args, output):
            if self.mask is None:
                return output
            hidden, *rest = output if isinstance(output, tuple) else (output,)
            hidden = hidden + rows_at_image_tokens(self.mask, self.rows[index], hidden.dtype, self.sequence_parallel)
            return (hidden, *rest) if isinstance(output, tuple) else hidden
        return add
