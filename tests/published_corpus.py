"""The corpus of published config.json files (tests/data/published_configs/): each file is a
model's config.json as its publisher ships it, shrunk in sizes only (hidden size, layers, heads,
head_dim, FFN widths, experts, vocab) so a random model of it runs in milliseconds; every other
key is kept, missing keys stay missing. index.json names where each file was copied from, the
original sizes, and the outcome the toolkit must give: "converts" (and verifies exactly), or a
one-line refusal (a substring of it). Flipping an outcome to "converts" is a one-line change.

`shrink` is how the files were made from the verbatim copies, kept so a new model is added the
same way. A multimodal wrapper (Gemma 3 4B/12B/27B: Gemma3ForConditionalGeneration) is shrunk
inside: its text_config as a text model, its vision_config to a tiny SigLIP tower; the language model
is what converts and is verified (toolkit/convert/wrapper.py).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "published_configs"
INDEX = CORPUS / "index.json"
CONVERTS = "converts"

# Sizes of the shrunk models. Layers: Gemma 3 keeps 6 so that its pattern (every 6th layer
# global) has a global layer; 4 elsewhere (2 per pipeline stage at PP 2). Heads: 4, with the
# original's kind of attention (MHA, one KV head, or GQA with 2 KV heads), all divisible by TP 2
# or fewer than it. Experts: at most 16, so top-8 routing still chooses (Mixtral's 8 stay 8).
SIZES = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "vocab_size": 256, "head_dim": 16,
         "moe_shared_expert_intermediate_size": 48,  # Nemotron 3's shared expert
         # multi-latent attention (DeepSeek-V3, Kimi-K2): every size distinct, as the tiny test models
         "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
         # DeepSeek Sparse Attention's indexer (DeepSeek-V3.2): 4 heads of 16, RoPE on 8 of them as the attention's,
         # the top 8 keys kept, fewer than the parity checks' tokens so that the sparse path runs
         "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
         # the gated delta net (Qwen3-Next): 2 key heads each serving 2 value heads, as the published 16 / 32
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 12,
         # Gemma 4's global layers: a head of their own, twice the sliding layers' as published (512 / 256)
         "global_head_dim": 32,
         # Nemotron-H's Mamba-2: 4 heads of 16 in 2 B/C groups (TP 2 splits both), chunks shorter than the sequences
         "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16}
# Nemotron-H keeps the first 16 symbols of its pattern, the first attention layer among them (Nano 9B v2's 14th;
# Nemotron 3 Nano 30B-A3B's MEMEM*EMEMEM*EME, Mamba-2, MoE and attention layers on both stages of PP 2)
LAYERS = {"gemma3_text": 6, "gemma4_text": 6, "nemotron_h": 16}
HEADS = 4
EXPERTS = 16
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# A wrapper's vision tower: toolkit/tinymodels.py's TINY_VISION, but 16 x 16 patches so that the
# published mm_tokens_per_image (256, pooled from the patches) is kept (Gemma 3's SigLIP); Qwen3.5's
# names its layers `depth` and its heads `num_heads`, and projects to the text model's width (out_hidden_size)
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 224, "patch_size": 14, "depth": 1, "num_heads": 2,
          "head_dim": 16}  # Pixtral's (Mistral Small 4) names its head size: hidden_size / num_attention_heads
# Gemma 4's tower names its KV heads and head sizes too, and keeps its 16-pixel patches; a smaller position table
VISION_OF = {"gemma4_vision": {"num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16, "patch_size": 16,
                               "position_embedding_size": 64}}
# Kimi-K2.5's tower names its sizes vt_* (its remote code's names) and mm_hidden_size / text_hidden_size (the
# projector's in and out widths); transformers' Kimi_K25VisionConfig reads hidden_size, ... instead, which the file
# leaves to the class (27 layers of 1152, the published sizes): both shrunk, the class's names written in, their
# original recorded as None (the class default), as a Gemma 3 text_config's vocabulary is
VISION_OF_WRAPPER = {"kimi_k25": {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_hidden_layers": 1,
                                  "vt_num_attention_heads": 2, "mm_hidden_size": 32}}
CLASS_VISION_SIZES = {"kimi_k25": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                   "num_attention_heads": 2}}
# A head whose consecutive MRoPE sections are kept in proportion where the file derives the head from hidden_size /
# heads (GLM-4.6V-Flash's text_config: 4096 / 32 = 128, whose 32 rotated frequencies are the sections' [8, 12, 12])
MROPE_HEAD = 32


def shrink(published: dict) -> tuple[dict, dict]:
    """(the shrunk config, the original values of the keys changed)."""
    from toolkit.convert.wrapper import wrapper_for

    wrapper = wrapper_for(published)
    if wrapper:
        return _shrink_wrapper(published, wrapper.text_config)
    cfg = dict(published)
    new = {k: v for k, v in SIZES.items() if k in cfg}
    if isinstance(cfg.get("pad_token_id"), int) and cfg["pad_token_id"] >= SIZES["vocab_size"]:
        del new["vocab_size"]  # the padding token's embedding row must exist (Phi-3.5, Phi-4-mini)
    new["num_hidden_layers"] = LAYERS.get(cfg["model_type"], 4)
    # head counts the file leaves to the config class stay left out (Gemma 3 4B's text_config: 8 / 4)
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None:
        new["num_attention_heads"] = HEADS
    if kv is not None:
        new["num_key_value_heads"] = HEADS if kv == heads else 1 if kv == 1 else 2
    global_kv = cfg.get("num_global_key_value_heads")  # Gemma 4's global layers: fewer KV heads than the sliding ones
    if global_kv is not None:
        new["num_global_key_value_heads"] = HEADS if global_kv == heads else 1 if global_kv == 1 else 2
    for key in EXPERT_KEYS:
        if key in cfg:
            new[key] = min(cfg[key], EXPERTS)
    k_heads, v_heads = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
    if isinstance(k_heads, int) and isinstance(v_heads, int) and v_heads % k_heads == 0:
        # value heads per key head as published (Qwen3.5-0.8B's 1, Qwen3-Next's 2)
        new["linear_num_value_heads"] = SIZES["linear_num_key_heads"] * (v_heads // k_heads)
    if isinstance(cfg.get("layer_types"), list):  # one per layer: the first ones (Qwen3-Next: 3 linear, 1 full)
        new["layer_types"] = cfg["layer_types"][:new["num_hidden_layers"]]
    if isinstance(cfg.get("hybrid_override_pattern"), str):  # Nemotron-H's, one symbol per layer likewise
        new["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:new["num_hidden_layers"]]
    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax-M2's, one per layer likewise
        new["attn_type_list"] = cfg["attn_type_list"][:new["num_hidden_layers"]]
    if isinstance(cfg.get("rotary_dim"), int) and isinstance(cfg.get("head_dim"), int):
        # MiniMax-M2's legacy partial RoPE: the same share of the smaller head (64 of 128 -> 8 of 16)
        new["rotary_dim"] = cfg["rotary_dim"] * SIZES["head_dim"] // cfg["head_dim"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    mrope = isinstance(rope, dict) and rope.get("mrope_section") and not rope.get("mrope_interleaved")
    if mrope and "head_dim" in cfg:
        new.pop("head_dim", None)  # GLM-4.5V's consecutive MRoPE sections count the head's frequencies: kept whole
    elif mrope and heads is not None:  # GLM-4.6V-Flash's head is hidden_size / heads: the sections scale with it
        new["hidden_size"] = HEADS * MROPE_HEAD
    original = {k: cfg.get(k) for k in new}
    cfg.update(new)
    if mrope and "head_dim" not in cfg and heads is not None:
        _shrink_mrope_sections(cfg, original, published_head=published["hidden_size"] // heads)
    _shrink_rope_factors(cfg, original)
    return cfg, original


def _shrink_mrope_sections(cfg: dict, original: dict, published_head: int) -> None:
    """Consecutive MRoPE sections (T, H, W frequencies) scaled from the published head to MROPE_HEAD: [8, 12, 12]
    of 128 x 0.5 / 2 = 32 frequencies -> [2, 3, 3] of 32 x 0.5 / 2 = 8."""
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    rope = cfg[key]
    sections = rope["mrope_section"]
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    published, shrunk = int(published_head * partial) // 2, int(MROPE_HEAD * partial) // 2
    assert sum(sections) == published and all(s * shrunk % published == 0 for s in sections), (sections, published)
    original[f"{key}.mrope_section"] = sections
    cfg[key] = {**rope, "mrope_section": [s * shrunk // published for s in sections]}


def _shrink_wrapper(published: dict, text_key: str) -> tuple[dict, dict]:
    """The text config shrunk as a text model; its vocabulary too where the class default holds it
    (Gemma3TextConfig's 262,208 rows would make the tiny model 16M parameters); the vision tower tiny."""
    cfg = dict(published)
    text = dict(published[text_key])
    text.setdefault("vocab_size", None)  # recorded as None among the original sizes: the class default
    cfg[text_key], text_original = shrink(text)
    _shrink_mla_head(cfg[text_key], text_original)
    original = {text_key: text_original}
    vision = published.get("vision_config")
    if isinstance(vision, dict):
        sizes = {k: v for k, v in {**VISION, **VISION_OF.get(vision.get("model_type"), {})}.items() if k in vision}
        sizes.update({k: v for k, v in VISION_OF_WRAPPER.get(published["model_type"], {}).items() if k in vision})
        for key in ("out_hidden_size", "text_hidden_size"):  # the projector's output: the text model's width
            if key in vision:
                sizes[key] = cfg[text_key]["hidden_size"]
        added = {k: v for k, v in CLASS_VISION_SIZES.get(published["model_type"], {}).items() if k not in vision}
        cfg["vision_config"] = {**vision, **sizes, **added}
        original["vision_config"] = {**{k: vision[k] for k in sizes}, **dict.fromkeys(added)}
    return cfg, original


def _shrink_mla_head(cfg: dict, original: dict) -> None:
    """Mistral 4's text config writes its multi-latent head size (head_dim = qk_head_dim = qk_nope + qk_rope) and
    RoPE's share of it (partial_rotary_factor = qk_rope / head_dim), which its config class derives from them:
    shrunk with the MLA sizes so they stay as derived."""
    if cfg.get("model_type") != "mistral4":
        return
    head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    original.update({k: cfg.get(k) if k != "head_dim" else original.get("head_dim", cfg.get(k))
                     for k in ("head_dim", "qk_head_dim") if k in cfg})
    cfg.update({k: head for k in ("head_dim", "qk_head_dim") if k in cfg})
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        original["rope_parameters.partial_rotary_factor"] = rope["partial_rotary_factor"]
        cfg["rope_parameters"] = {**rope, "partial_rotary_factor": cfg["qk_rope_head_dim"] / head}


def _shrink_rope_factors(cfg: dict, original: dict) -> None:
    """LongRoPE has one factor per rotated frequency, so a smaller head has fewer: keep evenly
    spaced ones, the first and the last included."""
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, dict) or "long_factor" not in scaling:
        return
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    pairs = int(head_dim * cfg.get("partial_rotary_factor", 1.0)) // 2
    original["rope_scaling"] = scaling
    cfg["rope_scaling"] = dict(scaling)
    for key in ("long_factor", "short_factor"):
        factors = scaling.get(key)
        if isinstance(factors, list):
            cfg["rope_scaling"][key] = [factors[round(i * (len(factors) - 1) / (pairs - 1))] for i in range(pairs)]


def index() -> dict[str, dict]:
    return json.loads(INDEX.read_text())


def config(name: str) -> dict:
    return json.loads((CORPUS / f"{name}.json").read_text())


def converting() -> list[str]:
    """The entries that convert and are verified against HF's logits."""
    return [name for name, entry in index().items() if entry["outcome"] == CONVERTS and "unverified" not in entry]


def distinct_converting() -> list[str]:
    """converting(), without an entry whose shrunk file equals an earlier one's (Mixtral 8x7B Instruct's and
    the base's, Qwen3 0.6B's and 1.7B's): the same model again. The first of them stands for both."""
    first = {json.dumps(config(name), sort_keys=True): name for name in reversed(converting())}
    return [name for name in converting() if name in first.values()]


def converting_unverified() -> list[str]:
    """The entries that convert but that HF's model cannot be the reference of here (index.json "unverified" says why)."""
    return [name for name, entry in index().items() if entry["outcome"] == CONVERTS and "unverified" in entry]


def refused() -> list[str]:
    return [name for name, entry in index().items() if entry["outcome"] != CONVERTS]


def build_model(name: str, directory: Path, leave_out: tuple[str, ...] = (), sizes: dict | None = None) -> Path:
    """A random model of the shrunk config (less the keys in `leave_out`, with other `sizes`), in the published dtype,
    with that config.json itself (not transformers' re-save of it) beside the weights. Where the config
    has an FP8 quantization_config, the weights are stored as published: FP8 with block scales
    (toolkit/tinymodels.py quantize_fp8) and the expert bias in float32 (HF's _keep_in_fp32_modules_strict);
    an MXFP4 one (gpt-oss), the fused experts as MXFP4 blocks and scales (quantize_mxfp4)."""
    from transformers import CONFIG_MAPPING

    from toolkit.tinymodels import kimi_k25_layers_as_published, quantize_fp8, quantize_mxfp4, save_random_model

    cfg = {k: v for k, v in {**config(name), **(sizes or {})}.items() if k not in leave_out}
    quantization = cfg.get("quantization_config")
    mxfp4 = isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
    # gpt-oss's file names no dtype: its checkpoints hold bf16 beside the MXFP4 experts (dequantized to bf16)
    # a wrapper may name it in its text_config only (Qwen3.5-0.8B)
    text = language_config(cfg)
    dtype = (cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype")
             or ("bfloat16" if mxfp4 else "float32"))
    model_type = transformers_model_type(cfg)
    # as its own model_type: transformers lays out the saved experts by it (Kimi-K2's kimi_k2 has no layout)
    model_config = CONFIG_MAPPING[model_type].from_dict(json.loads(json.dumps({**cfg, "model_type": model_type})))
    save_random_model(model_config, directory, dtype=dtype)
    if model_type == "kimi_k25":
        kimi_k25_layers_as_published(directory)
    if mxfp4:
        quantize_mxfp4(directory)
    elif isinstance(quantization, dict):
        quantize_fp8(directory, tuple(cfg["quantization_config"]["weight_block_size"]))
        _expert_bias_in_float32(directory)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return directory


def unquantized_text_config(name: str) -> dict:
    """build_model's `sizes` for an entry's wrapper less its text_config's quantization_config (Kimi-K2.5's INT4,
    refused as published): the language model that converts."""
    text = config(name)["text_config"]
    return {"text_config": {k: v for k, v in text.items() if k != "quantization_config"}}


def transformers_model_type(cfg: dict) -> str:
    """The model_type of the transformers config class that reads cfg: a wrapper's own (Gemma3Config
    builds Gemma3ForConditionalGeneration), else its family's class for it (kimi_k2 is read as deepseek_v3)."""
    from toolkit.convert.wrapper import wrapper_for
    from toolkit.families import family_for

    if wrapper_for(cfg):
        return cfg["model_type"]
    return family_for(cfg["model_type"]).config_class_of.get(cfg["model_type"], cfg["model_type"])


def language_config(cfg: dict) -> dict:
    """The config of the model that converts: a wrapper's text config (toolkit/convert/wrapper.py's
    reading of it), else cfg itself."""
    from toolkit.convert.wrapper import text_config, wrapper_for

    wrapper = wrapper_for(cfg)
    return text_config(cfg, wrapper, CORPUS / "config.json") if wrapper else cfg


def _expert_bias_in_float32(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    from toolkit.families import HF_FLOAT32_BUFFERS

    tensors = load_file(directory / "model.safetensors")
    tensors.update((k, v.float()) for k, v in tensors.items() if k.endswith(HF_FLOAT32_BUFFERS))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def convert_options(name: str) -> dict:
    """hf_to_megatron options an entry converts (or is refused) with, beyond the layout: index.json "convert"."""
    return index()[name].get("convert", {})


def published_sizes(name: str) -> dict:
    """An entry's config at the published sizes (index.json original_sizes put back: a key recorded None, which the
    file leaves to its class, taken out again; "rope_parameters.mrope_section" into its dict)."""
    cfg = json.loads(json.dumps(config(name)))

    def restore(part: dict, sizes: dict) -> None:
        for key, value in sizes.items():
            outer, _, inner = key.partition(".")
            if inner:
                part[outer] = {**part[outer], inner: value}
            elif isinstance(value, dict) and isinstance(part.get(key), dict):
                restore(part[key], value)
            elif value is None:
                part.pop(key, None)
            else:
                part[key] = value

    restore(cfg, index()[name]["original_sizes"])
    return cfg


def wrapper_counts(name: str) -> tuple:
    """(the language model's spec, HF's whole wrapper's parameters, its language model's parameters (lm_head too),
    those a token goes through) of an entry at its published sizes, as transformers 5.24 builds the wrapper's class on
    the meta device; the routed experts counted num_experts_per_tok of n_routed_experts."""
    import torch
    import transformers

    from toolkit.convert.wrapper import wrapper_for
    from toolkit.families import spec_from_config

    cfg = published_sizes(name)
    wrapper = wrapper_for(cfg)
    spec = spec_from_config(language_config(cfg))[1]
    hf_config = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        model = getattr(transformers, wrapper.architecture)(hf_config)
    # transformers' module names (model.language_model.*, lm_head) are its save's, reversed by its conversion mapping
    language = {n: p.numel() for n, p in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    share = spec.moe_topk / spec.num_experts if spec.is_moe else 1
    active = sum(v * share if ".mlp.experts." in n else v for n, v in language.items())
    return spec, sum(p.numel() for p in model.parameters()), sum(language.values()), int(active)
