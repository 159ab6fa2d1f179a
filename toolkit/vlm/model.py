"""Qwen3-VL on megatron-core: the converted language model (GPTModel of the family's spec, TP/PP as any text model)
with transformers' vision tower on the first pipeline stage, composed in one forward:

    positions    [3, b, s] MRoPE positions from the image grids      (toolkit.vlm.positions, every stage)
    vision       pixels -> image-token rows and DeepStack rows       (toolkit.vlm.vision_tower, first stage)
    embeddings   the decoder's input with the image tokens' replaced (toolkit.vlm.image_tokens, first stage)
    decoder      GPTModel with interleaved MRoPE                     (toolkit.blocks.rope_mrope)
                 and DeepStack after its first layers                (toolkit.vlm.deepstack, first stage)

transformers 5.24's Qwen3VLForConditionalGeneration is the reference (tests/test_vlm_model.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.errors import ConfigError
from toolkit.vlm.deepstack import DeepStack
from toolkit.vlm.image_tokens import image_token_mask, place_image_embeds
from toolkit.vlm.positions import mrope_position_ids
from toolkit.vlm.vision_tower import VisionTower, load_vision_tower

# Qwen3VLTextRotaryEmbedding's mrope_section where rope_parameters name none (transformers 5.24)
DEFAULT_MROPE_SECTION = [24, 20, 20]


class VisionLanguageModel(torch.nn.Module):
    """forward(input_ids, token_types, pixel_values, image_grid_thw) -> GPTModel's output on this stage: logits
    [b, s, vocab / TP] on the last stage (the loss per token with `labels`), the hidden states elsewhere."""

    def __init__(self, language_model, vision: VisionTower | None, vocab_size: int, image_token_id: int,
                 spatial_merge_size: int, deepstack_layers: int):
        super().__init__()
        self.language_model = language_model
        self.vocab_size = vocab_size  # the true vocabulary: the logits' columns past it are TP padding
        self.vision = vision  # None off the first pipeline stage
        self.image_token_id, self.spatial_merge_size = image_token_id, spatial_merge_size
        self.deepstack = DeepStack(language_model, deepstack_layers, language_model.pre_process)

    # What megatron-core's pipeline schedules read and call on the model they are given
    @property
    def config(self):
        return self.language_model.config

    @property
    def model_type(self):
        return self.language_model.model_type

    def set_input_tensor(self, tensor) -> None:
        self.language_model.set_input_tensor(tensor)

    def _zero_from_trained_tower(self) -> torch.Tensor | float:
        """0, in the graph of every trained tower parameter: a micro-batch without images still gives each a
        gradient (of zeros), so that every data-parallel rank has the same gradients for DeepSpeed to reduce
        (without it ZeRO's reduction mismatched over DP where one rank's micro-batch held text alone)."""
        trained = [p for p in self.vision.parameters() if p.requires_grad] if self.vision is not None else []
        return sum(p.sum() for p in trained) * 0.0 if trained else 0.0

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        """The language model's (megatron-core's keys, as a text model's), and the tower's tensors under `vision.`,
        whole on each first-stage rank (replicated over TP and DP): what the layout-independent state reads."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        state = self.language_model.sharded_state_dict(*args, **kwargs)
        if self.vision is not None:
            state.update({f"vision.{name}": make_sharded_tensor_for_checkpoint(param, f"vision.{name}")
                          for name, param in self.vision.model.named_parameters()})
        return state

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """`position_ids`: [3, b, s] positions to use instead of those the image grids give."""
        if position_ids is None:
            position_ids = mrope_position_ids(token_types, image_grid_thw, self.spatial_merge_size)
        if not self.language_model.pre_process:
            return self.language_model(input_ids, position_ids, None, labels=labels)
        embeds = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        mask, deepstack_rows = None, []
        if pixel_values is not None:
            visual = self.vision(pixel_values, image_grid_thw)
            mask = image_token_mask(input_ids, self.image_token_id)
            embeds = place_image_embeds(embeds, mask, visual.embeds, self.language_model.config.sequence_parallel)
            deepstack_rows = visual.deepstack
        else:
            embeds = embeds + self._zero_from_trained_tower()
        with self.deepstack.features(mask, deepstack_rows):
            return self.language_model(input_ids, position_ids, None, decoder_input=embeds, labels=labels)


def build_vision_language_model(wrapper_dir: str | Path, checkpoint_dir: str | Path, tp: int = 1, pp: int = 1,
                                dtype: torch.dtype = torch.float32,
                                sequence_parallel: bool = False) -> VisionLanguageModel:
    """The model of a Qwen3-VL wrapper checkpoint (its config and vision tower) and the language model converted
    from it (`toolkit convert hf-to-megatron`), for this process's rank of TP x PP (parallel_state initialised),
    with megatron-core's sequence parallelism where asked (TP > 1; sequences a multiple of TP)."""
    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model, transformer_config

    meta = CheckpointMeta.read(Path(checkpoint_dir))
    spec = meta.model_spec
    config = wrapper_config(wrapper_dir, spec, checkpoint_dir)
    layout = Layout(tp, pp, meta.vocab_divisor)
    config_of_layout = transformer_config(spec, layout, dtype, sequence_parallel=sequence_parallel)
    gpt = build_gpt_model(spec, layout, dtype, config_of_layout)
    load_converted(gpt, checkpoint_dir, meta=meta)
    return around_language_model(gpt, wrapper_dir, config, spec, dtype)


def wrapper_config(wrapper_dir: str | Path, spec, checkpoint_dir: str | Path):
    """The wrapper's Qwen3VLConfig, refused in one line where it or the checkpoint is not Qwen3-VL's."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(wrapper_dir))  # Qwen3VLConfig
    if spec.family != "qwen3_vl" or config.model_type != "qwen3_vl":
        raise ConfigError(f"{checkpoint_dir} ({spec.family}) with {wrapper_dir} ({config.model_type}): images run "
                          "through Qwen3-VL (qwen3_vl) only so far: give a qwen3_vl checkpoint and its wrapper")
    return config


def around_language_model(gpt, wrapper_dir: str | Path, config, spec, dtype: torch.dtype) -> VisionLanguageModel:
    """`gpt` (this rank's converted language model, loaded) with interleaved MRoPE, DeepStack and, on the first
    stage, the wrapper's vision tower."""
    from toolkit.blocks.rope_mrope import install_interleaved_mrope

    rope = config.text_config.rope_parameters
    install_interleaved_mrope(gpt, spec.head_dim, spec.rope_theta, rope.get("mrope_section", DEFAULT_MROPE_SECTION))
    vision = load_vision_tower(wrapper_dir, dtype) if gpt.pre_process else None
    if vision is not None and torch.cuda.is_available():
        vision.cuda()
    return VisionLanguageModel(gpt, vision, spec.vocab_size, config.image_token_id,
                               config.vision_config.spatial_merge_size,
                               len(config.vision_config.deepstack_visual_indexes))
