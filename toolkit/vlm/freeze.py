"""`vlm.freeze`: the parts of a vision-language model left untrained, as LLaMA-Factory names them.

    vision     the tower's encoder (patch embedding, position grid, blocks)
    projector  what maps its features into the language model: Qwen3-VL's patch merger and DeepStack mergers
               (LLaMA-Factory's `visual.merger`, with the DeepStack mergers, which project as it does)
    language   the language model (megatron-core's GPTModel: embedding, decoder, output layer)

Frozen before DeepSpeed sees the parameters, so that its optimizer holds only the trained ones.
"""

from __future__ import annotations

# The tower's modules (transformers' Qwen3VLVisionModel) that project into the language model
PROJECTOR_MODULES = ("merger.", "deepstack_merger_list.")


def part_of(name: str) -> str:
    """The vlm.freeze part of a VisionLanguageModel parameter, by its name."""
    if name.startswith("language_model."):
        return "language"
    inside = name.removeprefix("vision.model.")
    return "projector" if inside.startswith(PROJECTOR_MODULES) else "vision"


def freeze(model, parts: list[str]) -> None:
    """requires_grad off for every parameter of `parts` (this rank's: the tower is on the first stage only)."""
    for name, param in model.named_parameters():
        if part_of(name) in parts:
            param.requires_grad_(False)
