"""Qwen3-VL (qwen3_vl, qwen3_vl_moe wrappers; language models qwen3_vl_text, qwen3_vl_moe_text): Qwen3 / Qwen3-MoE
with an interleaved MRoPE inside Qwen3VL(Moe)ForConditionalGeneration (toolkit/families/qwen3_vl.py).

HF is the reference: the wrapper itself on text (transformers has no causal-LM class of the language model
alone), against megatron-core loading our checkpoints at TP2 x PP2 (dense) and TP2 x PP2 x EP2 (MoE), both
formats, the MoE with its experts as published ([E, hidden, 2 x ffn]) and as transformers saves them ([E, 2 x ffn,
hidden]): within 1e-4 in fp32, in the one launch of tests/test_published_parity.py (the published configs:
tests/test_published_configs.py's). The pieces' guards are single-process, on HF's own model: each moves its
logits far past that tolerance.

The MRoPE finding, as for Qwen3.5: for text the three position streams are equal and
Qwen3VLTextRotaryEmbedding's interleaving copies values already there, so it is plain rotate-half RoPE bit for
bit whatever mrope_section says; with unequal streams it is not (the tiny model's sections give H and W two
frequencies each), so the parity launch proves the reduction, not an inert MRoPE. DeepStack adds visual
features only at image tokens (none on text)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.moe_reference import routers_without_renormalising
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.wrapper import open_hf
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import QWEN3_VL, make_tiny_qwen3_vl_multimodal

LM = "model.language_model."


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    """The wrappers: `vl` (dense), `vl-moe` (experts fused as published), `vl-moe-saved` (as transformers saves
    them), fp32 for parity and `-bf16` for round trips, each seeded on its own."""
    root = tmp_path_factory.mktemp("qwen3-vl")
    models = {}
    for i, (name, moe, saved) in enumerate((("vl", False, False), ("vl-moe", True, False),
                                            ("vl-moe-saved", True, True))):
        models[name] = make_tiny_qwen3_vl_multimodal(root / name, seed=170 + i, moe=moe, as_saved=saved)
        models[f"{name}-bf16"] = make_tiny_qwen3_vl_multimodal(root / f"{name}-bf16", "bfloat16", seed=180 + i,
                                                               moe=moe, as_saved=saved)
    return models


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py (the dense ones at
    EP 1, the EP ranks then data-parallel): each wrapper in both formats, the transformers-saved MoE in one; all
    must match."""
    pairs = []
    for name, ep, formats in (("vl", 1, ("torch", "torch_dist")), ("vl-moe", 2, ("torch", "torch_dist")),
                              ("vl-moe-saved", 2, ("torch",))):
        for fmt in formats:
            pairs.append((models[name], hf_to_megatron(models[name], tmp_path / f"qwen3-{name}-{fmt}", tp=2, pp=2,
                                                       ep=ep, fmt=fmt, progress=False)))
    return pairs, len(pairs)


def _spec(src):
    return spec_from_config(open_hf(src).config)[1]


def test_settings_and_refusals(tiny_qwen3_vl):
    dense, moe = _spec(tiny_qwen3_vl["vl"]), _spec(tiny_qwen3_vl["vl-moe"])
    assert (dense.family, dense.head_dim, dense.rope_theta, dense.is_moe) == ("qwen3_vl", 12, 1e6, False)
    assert (moe.family, moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_renormalise) == (
        "qwen3_vl_moe", 8, 2, 36, True)
    assert settings_for(dense).transformer["qk_layernorm"] and settings_for(moe).transformer["qk_layernorm"]
    text = json.loads((tiny_qwen3_vl["vl-moe"] / "config.json").read_text())["text_config"]
    # the published 30B-A3B writes norm_topk_prob, which Qwen3VLMoeTextTopKRouter never reads: always renormalised
    assert spec_from_config({**text, "norm_topk_prob": False})[1].moe_renormalise
    assert spec_from_config({**text, "mlp_only_layers": [0]})[1].moe_layers == "0111"
    with pytest.raises(ConversionError, match="qwen3_vl with attention_bias=True"):
        spec_from_config({**json.loads((tiny_qwen3_vl["vl"] / "config.json").read_text())["text_config"],
                          "attention_bias": True})


def _rope_cos_sin(section, head_dim, position_ids):
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={**QWEN3_VL["rope_parameters"],
                                                                   "mrope_section": section})
    return Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)


def test_mrope_on_text_positions_is_plain_rope_bit_for_bit():
    """Qwen3VLTextRotaryEmbedding with the three streams equal (text) against megatron-core's RotaryEmbedding (the
    same base, every dimension rotated): equal cos and sin, for the tiny model's mrope_section and the published
    one alike. Guard: the H stream shifted changes them (MRoPE is live: the equality is the streams')."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq = 40
    text = torch.arange(seq)[None, None].expand(3, 1, -1)
    for section, head_dim in (([2, 2, 2], 12), ([24, 20, 20], 128)):
        cos, sin = _rope_cos_sin(section, head_dim, text)
        rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=1e6, use_cpu_initialization=True)
        freqs = rope.get_freqs_non_repeated(seq)  # what get_emb concatenates twice (rotate-half), off the GPU
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos[0], emb.cos()) and torch.equal(sin[0], emb.sin()), section
    shifted = text.clone()
    shifted[1] += 7
    assert not torch.equal(_rope_cos_sin([2, 2, 2], 12, shifted)[0], _rope_cos_sin([2, 2, 2], 12, text)[0])


def hf_logits(src, edit=None, inputs=None):
    from transformers import AutoModelForImageTextToText

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    tokens = reference_tokens(model.config.text_config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        if edit:
            edit(model)
        return model(input_ids=tokens, **(inputs or {})).logits


def _router_not_renormalised(model):
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

    routers_without_renormalising(model, m.Qwen3VLMoeTextTopKRouter)


def _halves_read_interleaved(model):
    """Each expert's gate_up as if gate and up alternated (gpt-oss's layout) instead of being halves."""
    for layer in model.model.language_model.layers:
        w = layer.mlp.experts.gate_up_proj
        ffn = w.shape[1] // 2
        w.copy_(torch.stack((w[:, :ffn], w[:, ffn:]), dim=2).reshape(w.shape))


def test_guards_each_piece_moves_hf_logits_past_the_tolerance(tiny_qwen3_vl):
    """HF's own wrapper: the MoE router without renormalising (Qwen3-MoE's norm_topk_prob false), the fused halves
    taken as interleaved, and the H / W streams of MRoPE differing from T: each moves the logits more than 100x the
    parity tolerance; equal streams given explicitly change nothing."""
    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN

    far = 100 * FP32_TOLERANCE
    dense, moe = tiny_qwen3_vl["vl"], tiny_qwen3_vl["vl-moe"]
    base = {"dense": hf_logits(dense), "moe": hf_logits(moe)}
    assert (hf_logits(moe, edit=_router_not_renormalised) - base["moe"]).abs().max() > far
    assert (hf_logits(moe, edit=_halves_read_interleaved) - base["moe"]).abs().max() > far
    positions = torch.arange(DEFAULT_SEQ_LEN)[None, None].expand(3, DEFAULT_BATCH, -1).clone()
    assert (hf_logits(dense, inputs={"position_ids": positions}) - base["dense"]).abs().max() == 0
    positions[1:] //= 3  # the H and W streams of an image-like grid
    assert (hf_logits(dense, inputs={"position_ids": positions}) - base["dense"]).abs().max() > far


def test_the_published_and_the_saved_expert_layouts_read_alike(tiny_qwen3_vl):
    """transformers loads [E, hidden, 2 x ffn] (published) transposed and [E, 2 x ffn, hidden] (its own save) as
    it is; the converter's view gives each expert's gate / up / down alike from both, as the file's transpose."""
    published, saved = tiny_qwen3_vl["vl-moe"], tiny_qwen3_vl["vl-moe-saved"]
    from safetensors import safe_open

    with safe_open(str(published / "model.safetensors"), "pt") as f:
        assert list(f.get_slice(LM + "layers.0.mlp.experts.gate_up_proj").get_shape()) == [8, 64, 72]
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        assert list(f.get_slice(LM + "layers.0.mlp.experts.gate_up_proj").get_shape()) == [8, 72, 64]
    for src in (published, saved):
        view = open_hf(src)
        gate = view.read("model.layers.1.mlp.experts.3.gate_proj.weight")
        up = view.read("model.layers.1.mlp.experts.3.up_proj.weight")
        down = view.read("model.layers.1.mlp.experts.3.down_proj.weight")
        from transformers import AutoModelForImageTextToText

        experts = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).model.language_model.layers[
            1].mlp.experts
        assert torch.equal(torch.cat((gate, up)), experts.gate_up_proj[3].detach()), src.name
        assert torch.equal(down, experts.down_proj[3].detach()), src.name


@pytest.mark.parametrize("name,ep,fmt", [("vl-bf16", 1, "torch"), ("vl-moe-bf16", 2, "torch_dist")])
def test_wrapper_round_trip_keeps_every_byte(tiny_qwen3_vl, tmp_path, name, ep, fmt):
    """Converted from the wrapper's files at TP2 x PP2 (x EP2), exported back into it: every tensor's bytes (the
    vision tower's, the fused experts' in the published layout) and the config as they were; exported alone,
    the language model's tensors under their text names, its config the text config (architectures: the decoder
    class, transformers having no causal-LM class of it)."""
    src = tiny_qwen3_vl[name]
    out = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, ep=ep, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    alone = megatron_to_hf(out, tmp_path / "alone", progress=False)
    theirs = {k.replace(LM, "model."): v for k, v in tensor_hashes(src).items() if not k.startswith("model.visual.")}
    assert tensor_hashes(alone) == theirs
    cfg = json.loads((alone / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == (("qwen3_vl_moe_text", ["Qwen3VLMoeTextModel"]) if ep == 2
                                                         else ("qwen3_vl_text", ["Qwen3VLTextModel"]))
