"""A model_type that names a known model the toolkit cannot read as published is refused with the
reason, before anything is written."""

from __future__ import annotations

import re

import pytest

from tests.test_convert_bad_input import convert_fails, edit_config


def test_multimodal_gemma3_without_its_text_config_is_refused_in_one_line(hf_copy, tmp_path):
    """model_type gemma3 is the multimodal wrapper (tests/test_gemma3_wrapper.py): its language
    model's config is `text_config`, which a text model relabelled gemma3 lacks."""
    src = hf_copy("gemma3")
    edit_config(src, model_type="gemma3")
    convert_fails(src, tmp_path / "out", "^[^\n]*" + re.escape("config.json: model_type 'gemma3' without a 'text_config' "
                                                              "object: not a multimodal checkpoint") + "[^\n]*$")


@pytest.mark.parametrize("model_type, reason", [
    ("ministral3", "Ministral 3 scales each query by 1 + llama_4_scaling_beta * ln(1 + floor(position / ")])
def test_frontier_families_megatron_core_cannot_express_are_refused_with_the_reason(hf_copy, tmp_path, model_type,
                                                                                  reason):
    """Issue 26: a family is refused in one line naming the missing piece (README repeats it). (Qwen3-Next and
    Llama 4, once here, convert: tests/test_family_qwen3_next.py, tests/test_family_llama4.py.)"""
    src = hf_copy("llama")
    edit_config(src, model_type=model_type)
    convert_fails(src, tmp_path / "out", "^[^\n]*" + re.escape(f"model_type {model_type!r} is not supported: {reason}")
                  + "[^\n]*$")


def test_ministral3s_query_scaling_is_what_the_refusal_names():
    """The refusal's reason on HF's own model (transformers' Ministral3ForCausalLM, YaRN with mscale = mscale_all_dim,
    original_max_position_embeddings 16): with llama_4_scaling_beta 0.1 the logits equal beta 0's bit for bit on the
    first 16 positions and move past them, where the per-position temperature applies."""
    import torch
    from transformers import Ministral3Config, Ministral3ForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    config = Ministral3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=64,
                              rope_parameters=rope, initializer_range=0.1)
    torch.manual_seed(0)
    model = Ministral3ForCausalLM(config).eval()
    tokens = torch.randint(0, 101, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scaled = model(tokens).logits
        model.config.rope_parameters = {**rope, "llama_4_scaling_beta": 0.0}
        unscaled = model(tokens).logits
    assert torch.equal(scaled[:, :16], unscaled[:, :16])
    assert (scaled[:, 16:] - unscaled[:, 16:]).abs().max() > 1e-2
