"""Ministral 3 (ministral3; published inside the mistral3 wrapper): Mistral's table with an explicit head_dim, YaRN
and the Llama-4 query scale, exact up to original_max_position_embeddings (toolkit/families/ministral3.py).

HF is the reference: megatron-core loading our checkpoints at TP2 x PP2 (the text model in both formats, the
wrapper's language model against Mistral3ForConditionalGeneration on text) gives HF's logits within 1e-4 in fp32 on
sequences inside the exact length, in the one launch of tests/test_published_parity.py. The query scale's guard is
single-process, on HF's own model: exactly 1 (bit for bit) below the bound, far off past it, which `verify` and the
recipe refuse in one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.errors import ConversionError, ToolkitError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_mistral3_multimodal, make_tiny_model

TEXT, VL = "ministral3", "ministral3-vl"


@pytest.fixture(scope="module")
def tiny_ministral3(tmp_path_factory):
    """The text model and the mistral3 wrapper around it, fp32 (parity) and `-bf16` (round trips)."""
    root = tmp_path_factory.mktemp("ministral3")
    return {TEXT: make_tiny_model(TEXT, root / TEXT, seed=210),
            f"{TEXT}-bf16": make_tiny_model(TEXT, root / f"{TEXT}-bf16", dtype="bfloat16", seed=211),
            VL: make_tiny_mistral3_multimodal(root / VL, seed=212, text_variant=TEXT),
            f"{VL}-bf16": make_tiny_mistral3_multimodal(root / f"{VL}-bf16", "bfloat16", seed=213, text_variant=TEXT)}


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 (x EP2 as DP) launch of tests/test_published_parity.py: the text model
    in both formats, the wrapper's language model; all must match (the launch's sequences, 32 tokens, are inside the
    64 exact ones)."""
    pairs = [(models[TEXT], hf_to_megatron(models[TEXT], tmp_path / f"ministral3-{fmt}", tp=2, pp=2, fmt=fmt,
                                           progress=False)) for fmt in ("torch", "torch_dist")]
    pairs.append((models[VL], hf_to_megatron(models[VL], tmp_path / "ministral3-vl-megatron", tp=2, pp=2,
                                         progress=False)))
    return pairs, len(pairs)


def test_settings_yarn_and_the_exact_length():
    spec = spec_from_config(make_config(TEXT).to_dict())[1]
    assert (spec.family, spec.head_dim, spec.num_kv_heads, spec.exact_seq_len, spec.window_size) == (
        "ministral3", 24, 2, 64, None)
    assert (spec.yarn["yarn_rotary_scaling_factor"], spec.yarn["yarn_original_max_position_embeddings"],
            spec.yarn["yarn_mscale"], spec.yarn["yarn_mscale_all_dim"]) == (4.0, 64, 1.0, 1.0)
    assert settings_for(spec).transformer["kv_channels"] == 24
    unscaled = make_config(TEXT).to_dict()
    unscaled["rope_parameters"] = {**unscaled["rope_parameters"], "llama_4_scaling_beta": 0.0}
    assert spec_from_config(unscaled)[1].exact_seq_len is None
    for beta in (None, "0.1"):
        cfg = make_config(TEXT).to_dict()
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "llama_4_scaling_beta": beta}
        with pytest.raises(ConversionError, match="llama_4_scaling_beta=.*: Ministral 3 scales its queries by it"):
            spec_from_config(cfg)


def _hf_logits(src, tokens, **config):
    from toolkit.families.hf_values import auto_causal_lm

    model = auto_causal_lm().from_pretrained(src, dtype=torch.float32, **config).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_the_query_scale_is_one_up_to_its_bound_and_moves_the_logits_past_it(tiny_ministral3):
    """HF's get_llama_4_attn_scale is exactly 1 on the first 64 positions: with or without it the logits are the same
    bit for bit there (what the conversion relies on); past them it moves them far more than the parity tolerance."""
    src = tiny_ministral3[TEXT]
    rope = make_config(TEXT).to_dict()["rope_parameters"]
    tokens = torch.randint(0, 251, (2, 128), generator=torch.Generator().manual_seed(0))
    scaled = _hf_logits(src, tokens)
    unscaled = _hf_logits(src, tokens, rope_parameters={**rope, "llama_4_scaling_beta": 0.0})
    assert torch.equal(scaled[:, :64], unscaled[:, :64])
    assert (scaled[:, 64:] - unscaled[:, 64:]).abs().max() > 1e-2
    # and YaRN is live on the tested positions: plain RoPE of the same base moves them far too
    plain = _hf_logits(src, tokens[:, :32], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "llama_4_scaling_beta": 0.1,
                                                             "original_max_position_embeddings": 64})
    assert (plain - scaled[:, :32]).abs().max() > 1e-2


def test_verify_and_training_past_the_exact_length_are_refused_in_one_line(tiny_ministral3, tmp_path):
    from tests.finetune_harness import recipe, recipe_prepare, write_uneven_data
    from toolkit.convert.parity import verify_many

    converted = hf_to_megatron(tiny_ministral3[f"{TEXT}-bf16"], tmp_path / "m", progress=False)
    with pytest.raises(ToolkitError, match="--seq-len 65 exceeds 64, the longest sequence ministral3 converts exactly"):
        verify_many([(tiny_ministral3[f"{TEXT}-bf16"], converted)], seq_len=65)
    data = write_uneven_data(tmp_path / "data.jsonl", 40)
    with pytest.raises(ToolkitError, match="data.seq_len 65 exceeds 64, the longest sequence ministral3 trains exactly"):
        recipe_prepare()(str(recipe(tmp_path, converted, data, data__seq_len=65)), [])


@pytest.mark.parametrize("name", [f"{TEXT}-bf16", f"{VL}-bf16"])
def test_round_trips_keep_every_byte(tiny_ministral3, tmp_path, name):
    """At TP2 x PP2: the text model back as Ministral3ForCausalLM, the wrapper's language model back into the
    wrapper (Pixtral tower and projector as stored), every tensor's bytes as they were."""
    src = tiny_ministral3[name]
    out = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, progress=False)
    back = megatron_to_hf(out, tmp_path / "back", progress=False, **({"wrapper": src} if name.startswith(VL) else {}))
    assert tensor_hashes(back) == tensor_hashes(src)
    if not name.startswith(VL):
        assert json.loads((back / "config.json").read_text())["architectures"] == ["Ministral3ForCausalLM"]


def test_published_size_counts_as_hf_builds_it():
    """Ministral-3-8B-Base-2512 (tests/data/published_configs ministral-3-8b-base-2512, at its published sizes):
    `toolkit memory`'s parameter count (toolkit.memory.params) of the language model equals HF's
    Mistral3ForConditionalGeneration's language model and lm_head built on the meta device, 8,489,553,920 (untied):
    NVIDIA Megatron-Bridge's "8.4B Language Model + 0.4B Vision Encoder" for it; the whole wrapper 8.92B."""
    from tests import published_corpus as corpus
    from toolkit.memory.params import total_params

    spec, whole, hf_total, _ = corpus.wrapper_counts("ministral-3-8b-base-2512")
    assert (spec.family, spec.tied_embeddings, spec.exact_seq_len) == ("ministral3", False, 16384)
    assert total_params(spec) == hf_total == 8_489_553_920
    assert (int(hf_total / 1e8), round((whole - hf_total) / 1e9, 1)) == (84, 0.4)
