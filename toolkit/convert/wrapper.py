"""Multimodal checkpoints whose language model is a family the toolkit converts (Gemma 3 4B / 12B /
27B as published: Gemma3ForConditionalGeneration; Qwen3.5 / 3.6: Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration; Mistral Small 4: Mistral3ForConditionalGeneration around a mistral4
text model; Gemma 4: Gemma4ForConditionalGeneration, laid out as Qwen3.5's), read as that language model.

transformers 5.23 saves Gemma 3's text model under `language_model.` (`language_model.model.*`,
`language_model.lm_head.weight` where untied: its _checkpoint_conversion_mapping reversed on save,
as the published files are), the vision tower and the projector beside it, and the text model's
config under `text_config`. Qwen3.5's keeps the text model's `model.*` under `model.language_model.*`
and `lm_head.weight` as it is, beside `model.visual.*` and the multi-token-prediction `mtp.*` (as
published, and as transformers' qwen3_5_text PrefixChange reads them into Qwen3_5ForCausalLM). Mistral3ForConditionalGeneration (transformers' llava conversion mapping) is saved as Gemma 3's, under
`language_model.model.*` and `language_model.lm_head.weight` beside `vision_tower.*` and
`multi_modal_projector.*`; its text model is whichever text_config.model_type names (its family's class),
tied as the wrapper's own tie_word_embeddings says (Mistral3Config's default true), and experts stored fused
(Mistral 4's) are read per expert through the wrapper's names.
The converter reads the language model through `LanguageModelView`:
the text config as the checkpoint's config.json, the prefixed tensors under their text-model names.
The megatron checkpoint is the text model; `megatron_to_hf(..., wrapper=DIR)` writes it back into
the wrapper, every other tensor of DIR copied as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import ConversionError

if TYPE_CHECKING:  # the CLI's help lists WRAPPERS without importing torch
    import torch

    from toolkit.convert.hf_source import HFCheckpoint


@dataclass(frozen=True)
class Wrapper:
    model_type: str  # the wrapper's config.json model_type
    text_config: str  # the key of the language model's config
    # (prefix in the wrapper, prefix in the language model alone) of the language model's tensors, in order
    renames: tuple[tuple[str, str], ...]
    text_architecture: str | None  # the HF class of the language model alone; None: its family's (text_config.model_type's)
    architecture: str  # the wrapper's HF class
    # The wrapper ties its lm_head to the embeddings as its own config's tie_word_embeddings says (class default
    # where the file leaves it out), whatever its text_config says (Qwen3_5ForConditionalGeneration, whose save
    # writes text_config.tie_word_embeddings false beside a top-level true for a tied model)
    ties_at_top_level: bool = False
    # The export into this wrapper writes the language model's experts fused where the wrapper's files hold them
    # fused (Glm46VForConditionalGeneration: transformers 5.24 reads no per-expert tensors into it), in the
    # family's FusedExperts layout; else as the family exports them
    experts_as_stored: bool = False

    def text_name(self, name: str) -> str | None:
        """A wrapper tensor's name in the language model alone; None outside the language model."""
        return next((text + name[len(outer):] for outer, text in self.renames if name.startswith(outer)), None)

    def wrapper_name(self, name: str) -> str:
        """A language-model tensor's name in the wrapper."""
        return next(outer + name[len(text):] for outer, text in self.renames if name.startswith(text))

    @property
    def prefixes(self) -> str:
        return ", ".join(outer + "*" for outer, _ in self.renames)


_QWEN3_5 = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
WRAPPERS = (
    Wrapper("gemma3", "text_config", (("language_model.", ""),), "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    Wrapper("qwen3_5", "text_config", _QWEN3_5, "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", True),
    Wrapper("qwen3_5_moe", "text_config", _QWEN3_5, "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
            True),
    # Gemma 4 31B / 26B-A4B as published: model.language_model.* beside model.vision_tower.* and model.embed_vision.*
    Wrapper("gemma4", "text_config", _QWEN3_5, "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    Wrapper("mistral3", "text_config", (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            None, "Mistral3ForConditionalGeneration", True),
    # Qwen3-VL: saved as Qwen3.5's (model.language_model.*, lm_head beside model.visual.*), tied as the wrapper's own
    # tie_word_embeddings says; the text model alone has no causal-LM class (its family's Qwen3VL(Moe)TextModel)
    Wrapper("qwen3_vl", "text_config", _QWEN3_5, None, "Qwen3VLForConditionalGeneration", True),
    Wrapper("qwen3_vl_moe", "text_config", _QWEN3_5, None, "Qwen3VLMoeForConditionalGeneration", True),
    # GLM-4.5V / GLM-4.6V: saved likewise (model.language_model.*, lm_head beside model.visual.*); the glm46v wrapper
    # holds GLM-4.6V's MoE language model (glm4v_moe_text) or GLM-4.6V-Flash's dense one (glm4v_text), read as its
    # text_config.model_type's family; GLM-4.1V-9B (glm4v) the same dense one
    Wrapper("glm4v", "text_config", _QWEN3_5, None, "Glm4vForConditionalGeneration", True),
    Wrapper("glm4v_moe", "text_config", _QWEN3_5, None, "Glm4vMoeForConditionalGeneration", True),
    Wrapper("glm46v", "text_config", _QWEN3_5, None, "Glm46VForConditionalGeneration", True, experts_as_stored=True),
    # Kimi-K2.5: DeepSeek-V3's language model (text_config model_type kimi_k2, read as deepseek_v3) saved as llava's
    # (transformers' kimi_k25 conversion mapping reversed on save): language_model.model.*, language_model.lm_head
    Wrapper("kimi_k25", "text_config", (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            None, "Kimi_K25ForConditionalGeneration", True),
    # Llama 4 Scout / Maverick: Llama4ForConditionalGeneration keeps Llama4ForCausalLM as `language_model`
    # (no conversion mapping), beside `vision_model.*` and `multi_modal_projector.*`; tied as its own flag says
    Wrapper("llama4", "text_config", (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            "Llama4ForCausalLM", "Llama4ForConditionalGeneration", True),
)
# Keys of the wrapper's config.json that describe the language model where its text_config leaves
# them out (transformers 5 writes them at the top level of the wrapper)
INHERITED = ("dtype", "torch_dtype", "tie_word_embeddings")


def wrapper_for(cfg: dict) -> Wrapper | None:
    return next((w for w in WRAPPERS if cfg.get("model_type") == w.model_type), None)


def text_config(cfg: dict, wrapper: Wrapper, where: Path) -> dict:
    text = cfg.get(wrapper.text_config)
    if not isinstance(text, dict):
        raise ConversionError(f"{where}: model_type {wrapper.model_type!r} without a {wrapper.text_config!r} object: "
                              "not a multimodal checkpoint this toolkit can read")
    inherited = {k: cfg[k] for k in INHERITED if k in cfg and k not in text}
    if wrapper.ties_at_top_level:
        inherited["tie_word_embeddings"] = _wrapper_ties(cfg, wrapper)
    architecture = wrapper.text_architecture
    if architecture is None:  # the text model's family's class; an unknown model_type is refused by its reader later
        family = _family(text)
        architecture = family.architecture if family else None
    return {**text, **inherited, "architectures": [architecture]}


def _wrapper_ties(cfg: dict, wrapper: Wrapper) -> bool:
    """tie_word_embeddings as the wrapper's config class reads it (its default where the file has none)."""
    from transformers import CONFIG_MAPPING

    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    return bool(CONFIG_MAPPING[wrapper.model_type].tie_word_embeddings)


class LanguageModelView:
    """An HFCheckpoint of a wrapper, seen as its language model (HFCheckpoint's interface)."""

    def __init__(self, src: HFCheckpoint, wrapper: Wrapper):
        self.wrapper, self.whole, self.dir = wrapper, src, src.dir
        self.experts = None  # the language model's experts, where stored fused, read per expert (fuse_experts)
        self.config = text_config(src.config, wrapper, src.dir / "config.json")
        self.config_bytes = (json.dumps(self.config, indent=2, sort_keys=True) + "\n").encode()
        self.tensors = {wrapper.text_name(name): e for name, e in src.tensors.items() if wrapper.text_name(name)}
        if not self.tensors:
            raise ConversionError(f"{src.dir} holds no tensor named {wrapper.prefixes}: not the language model of a "
                                  f"{wrapper.model_type} checkpoint as transformers saves it")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        entry = self.tensors.get(name)  # None: a fused tensor itself, read by self.experts
        if self.experts is not None and entry is not None and entry.file is None:  # one expert of a fused tensor
            return self.experts.read(name, rows, cols)
        return self.whole.read(self.wrapper.wrapper_name(name), rows, cols)

    def stored_name(self, name: str) -> str:
        """A language-model tensor's name in the wrapper's files."""
        return self.wrapper.wrapper_name(name)

    @property
    def holds_fused_experts(self) -> bool:
        """Whether the wrapper's files hold the language model's experts fused (some layer's)."""
        return self.experts is not None and bool(self.experts.layers)

    def fuse_experts(self, fused) -> None:
        """Show the language model's fused experts (`model.language_model.layers.*.mlp.experts.gate_up_proj`
        in the wrapper) per expert, as a text checkpoint's (toolkit/convert/fused_experts.py): the view
        reads the fused tensors through this one; every tensor of the wrapper stays where it is."""
        from toolkit.convert.fused_experts import FusedExpertsView

        self.experts = FusedExpertsView(self, fused)
        self.tensors = self.experts.tensors

    def tokenizer_files(self) -> list[Path]:
        return self.whole.tokenizer_files()

    def other_tensors(self) -> list[str]:
        """The wrapper's tensors outside the language model (vision tower, projector), in file order."""
        return [name for name in self.whole.tensors if self.wrapper.text_name(name) is None]


def open_hf(directory) -> HFCheckpoint | LanguageModelView:
    """An HF checkpoint directory as the converter reads it: a wrapper as its language model, a
    model with fused experts per expert (toolkit/convert/fused_experts.py), FP8 weights with block scales
    dequantized to bf16 (toolkit/convert/fp8.py); without the tensors HF's model ignores on load, which
    the view lists as `ignored` (toolkit/convert/ignored.py)."""
    from toolkit.convert import fp8, ignored
    from toolkit.convert.hf_source import HFCheckpoint

    from toolkit.convert.fused_experts import fused_view

    src = HFCheckpoint(directory)
    ignored.drop(src, None)  # transformers' own rules, over every tensor of the file (a wrapper's others too)
    wrapper = wrapper_for(src.config)
    if wrapper:
        text = src.config.get(wrapper.text_config)
        # at the top level, or in the text_config (Kimi-K2.5 as published)
        quantization = src.config.get("quantization_config", (text if isinstance(text, dict) else {}).get(
            "quantization_config"))
        if quantization is not None:
            raise ConversionError(_quantized(src.dir / "config.json", wrapper.model_type, quantization,
                                             "only unquantized multimodal checkpoints convert through their language model"))
        view = LanguageModelView(src, wrapper)
        family = _family(view.config)
        if family is not None and family.fused_experts is not None:  # Qwen3.5-MoE's, GLM-4.6V's, where stored fused
            view.fuse_experts(family.fused_experts)
    else:
        family = _family(src.config)
        fused = family.fused_experts if family else None  # experts stored fused (gpt-oss): read one at a time
        _refuse_unread_quantization(src, fused)
        # FP8 weights dequantized beneath a view of fused experts that has no MXFP4 of its own (Qwen3.5-MoE's)
        fp8_first = fp8.is_fp8(src.config) and (fused is None or not fused.mxfp4)
        view = fused_view(fp8.Fp8View(src) if fp8_first else src, fused)
    of_file = src.ignored
    ignored.drop(view, family)  # the family's rules (multi-token-prediction layers)
    view.ignored = {**of_file, **view.ignored}
    return view


def _quantized(where: Path, model_type: str, quantization, why: str) -> str:
    """The one line refusing a quantized checkpoint, naming its format."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    fmt = quantization.get("format") if isinstance(quantization, dict) else None
    if method == "compressed-tensors" or fmt is not None:  # Kimi-K2.5's INT4 experts, NVFP4 re-saves
        why = (f"its {fmt or 'compressed'} weights are decompressed by the compressed-tensors library, which defines "
               "that format (transformers' integration only calls it); " + why)
    return (f"{where}: a quantized {model_type} checkpoint (quantization_config.quant_method={method!r}"
            + (f", format={fmt!r}" if fmt is not None else "") + f") is not read: {why}")


def _refuse_unread_quantization(src: "HFCheckpoint", fused) -> None:
    """A text checkpoint quantized otherwise than the formats dequantized while reading (FP8 with block
    scales, toolkit/convert/fp8.py; gpt-oss's MXFP4 experts, toolkit/convert/fused_experts.py) is one line:
    its packed integer weights and scales (NVFP4, AWQ, GPTQ, INT4, bitsandbytes) would convert as garbage."""
    quantization = src.config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if quantization is None or method == "fp8" or (method == "mxfp4" and fused is not None and fused.mxfp4):
        return
    raise ConversionError(_quantized(src.dir / "config.json", src.config.get("model_type"), quantization,
                                     "only FP8 weights with block scales and gpt-oss's MXFP4 experts are dequantized "
                                     "while reading; convert the unquantized (bf16) release"))


def _family(cfg: dict):
    from toolkit.families import family_for

    try:
        return family_for(cfg.get("model_type"))
    except ConversionError:
        return None  # an unknown model_type: refused later, by the reader of its config


def open_wrapper(directory) -> LanguageModelView:
    view = open_hf(directory)
    if not isinstance(view, LanguageModelView):
        raise ConversionError(f"{directory} is not a multimodal checkpoint with a language model this toolkit reads "
                              f"(model_type {view.config.get('model_type')!r}; known: "
                              f"{', '.join(w.model_type for w in WRAPPERS)})")
    return view

