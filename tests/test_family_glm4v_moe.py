"""GLM-4.5V / GLM-4.6V (glm4v_moe, glm46v wrappers; language model glm4v_moe_text): GLM-4.5's MoE language model
without q/k norms and with an MRoPE, inside Glm4vMoeForConditionalGeneration / Glm46VForConditionalGeneration
(toolkit/families/glm4v_moe.py).

HF is the reference: the wrapper itself on text (transformers has no causal-LM class of the language model alone),
against megatron-core loading our checkpoints at TP2 x PP2 x EP2, both formats, GLM-4.5V's experts per expert and
GLM-4.6V's fused as transformers saves and reads them: within 1e-4 in fp32, in the one launch of
tests/test_published_parity.py (the published configs: tests/test_published_configs.py's). GLM-4.5's router, groups,
expert bias and shared experts keep their guards in tests/test_family_glm4_moe.py; the new pieces' guards are here,
single-process, on HF's own model.

The MRoPE finding: for text the three position streams are equal and Glm4vMoeTextRotaryEmbedding's chunks (of
mrope_section frequencies from T, H, W in turn) are all T's, so it is plain partial rotate-half RoPE bit for bit;
with unequal streams it is not (the tiny model's sections give H and W a frequency each)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.wrapper import open_hf
from toolkit.families import spec_from_config
from toolkit.tinymodels import GLM4V_MOE, make_tiny_glm4v_multimodal

LM = "model.language_model."


@pytest.fixture(scope="module")
def tiny_glm4v(tmp_path_factory):
    """`glm45v` (per-expert files) and `glm46v` (fused, as transformers saves Glm46V), fp32 for parity and `-bf16`
    for round trips, each seeded on its own."""
    root = tmp_path_factory.mktemp("glm4v")
    models = {}
    for i, name in enumerate(("glm45v", "glm46v")):
        models[name] = make_tiny_glm4v_multimodal(root / name, seed=190 + i, glm46v=name == "glm46v")
        models[f"{name}-bf16"] = make_tiny_glm4v_multimodal(root / f"{name}-bf16", "bfloat16", seed=195 + i,
                                                            glm46v=name == "glm46v")
    return models


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py: GLM-4.5V in both
    formats, GLM-4.6V (fused experts) in one; all must match."""
    pairs = [(models[name], hf_to_megatron(models[name], tmp_path / f"{name}-{fmt}", tp=2, pp=2, ep=2, fmt=fmt,
                                           progress=False))
             for name, fmt in (("glm45v", "torch"), ("glm45v", "torch_dist"), ("glm46v", "torch"))]
    return pairs, len(pairs)


def _text(src) -> dict:
    return json.loads((src / "config.json").read_text())["text_config"]


def test_settings(tiny_glm4v):
    for name in ("glm45v", "glm46v"):
        spec = spec_from_config(open_hf(tiny_glm4v[name]).config)[1]
        assert (spec.family, spec.qk_norm, spec.qkv_bias, spec.rotary_percent, spec.num_experts, spec.moe_layers,
                spec.moe_score_function, spec.moe_num_groups) == ("glm4v_moe", False, True, 0.5, 12, "0111",
                                                                  "sigmoid", 4), name
    # Glm4vMoeTextAttention has no q/k norms: use_qk_norm (the published file writes false) is never read
    assert not spec_from_config({**_text(tiny_glm4v["glm45v"]), "use_qk_norm": True})[1].qk_norm


def _rope_cos_sin(section, position_ids, head_dim=16):
    from transformers import Glm4vMoeTextConfig
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextRotaryEmbedding

    config = Glm4vMoeTextConfig(head_dim=head_dim, rope_parameters={**GLM4V_MOE["rope_parameters"],
                                                                    "mrope_section": section})
    return Glm4vMoeTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)


def test_mrope_on_text_positions_is_plain_partial_rope_bit_for_bit():
    """Glm4vMoeTextRotaryEmbedding with the three streams equal (text) against megatron-core's RotaryEmbedding
    (rotary_percent 0.5, the same base): equal cos and sin for the tiny model's mrope_section and the published one
    ([8, 12, 12] of head_dim 128's 32 frequencies). Guard: the H stream shifted changes them."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq = 40
    text = torch.arange(seq)[None, None].expand(3, 1, -1)
    for section, head_dim in (([2, 1, 1], 16), ([8, 12, 12], 128)):
        cos, sin = _rope_cos_sin(section, text, head_dim)
        rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=0.5, rotary_base=1e6, use_cpu_initialization=True)
        freqs = rope.get_freqs_non_repeated(seq)
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos[0], emb.cos()) and torch.equal(sin[0], emb.sin()), section
    shifted = text.clone()
    shifted[1] += 7
    assert not torch.equal(_rope_cos_sin([2, 1, 1], shifted)[0], _rope_cos_sin([2, 1, 1], text)[0])


def hf_logits(src, inputs=None, **load):
    from transformers import AutoModelForImageTextToText

    return logits_of(AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32, **load), inputs)


def logits_of(model, inputs=None):
    """An HF wrapper's fp32 logits on the parity launch's text tokens (toolkit.convert.parity.reference_tokens)."""
    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    tokens = reference_tokens(model.config.text_config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        return model.eval()(input_ids=tokens, **(inputs or {})).logits


def test_guards_mrope_streams_move_hf_logits_past_the_tolerance(tiny_glm4v):
    """HF's own wrapper: equal streams given explicitly change nothing; H and W streams
    far from T's move the logits more than 100x the parity tolerance (the text reduction is not an inert MRoPE)."""
    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN

    src = tiny_glm4v["glm45v"]
    base = hf_logits(src)
    positions = torch.arange(DEFAULT_SEQ_LEN)[None, None].expand(3, DEFAULT_BATCH, -1).clone()
    assert (hf_logits(src, {"position_ids": positions}) - base).abs().max() == 0
    positions[1:] *= 1000  # H and W hold the two lowest of 4 frequencies at base 1e6: far positions turn them
    assert (hf_logits(src, {"position_ids": positions}) - base).abs().max() > 100 * FP32_TOLERANCE


@pytest.mark.parametrize("name,fmt", [("glm45v-bf16", "torch"), ("glm46v-bf16", "torch_dist")])
def test_wrapper_round_trip_keeps_every_byte(tiny_glm4v, tmp_path, name, fmt):
    """Converted at TP2 x PP2 x EP2 from the wrapper's files, exported back into it: every tensor's bytes (the vision
    tower's; GLM-4.5V's experts per expert, GLM-4.6V's fused as its files hold them; the float32 router and bias as
    stored) and the config as they were; exported alone, per expert under the text names."""
    src = tiny_glm4v[name]
    out = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    alone = megatron_to_hf(out, tmp_path / "alone", progress=False)
    names = set(tensor_hashes(alone))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    cfg = json.loads((alone / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("glm4v_moe_text", ["Glm4vMoeTextModel"])


def test_published_size_counts_as_hf_builds_it():
    """GLM-4.6V (tests/data/published_configs glm-4.6v, at its published sizes): `toolkit memory`'s parameter counts
    (toolkit.memory.params) of the language model equal HF's Glm46VForConditionalGeneration's language model and
    lm_head built on the meta device: 106.85B, 13.42B a token goes through; the card's "106B" and, without the
    embedding and output layer (as GLM-4.5's figures count, tests/test_memory_moe_families.py), "12B active"."""
    from tests import published_corpus as corpus
    from toolkit.memory.params import active_params, total_params

    spec, _, hf_total, hf_active = corpus.wrapper_counts("glm-4.6v")
    assert (total_params(spec), active_params(spec)) == (hf_total, hf_active) == (106_852_245_504, 13_424_123_904)
    embeddings = 2 * spec.vocab_size * spec.hidden_size
    assert (int(hf_total / 1e9), int((hf_active - embeddings) / 1e9)) == (106, 12)
