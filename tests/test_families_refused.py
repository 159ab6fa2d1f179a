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
    ("llama4_text", "Llama 4's chunked local attention (attention_chunk_size"),
    ("llama4", "Llama 4's chunked local attention (attention_chunk_size")])
def test_frontier_families_megatron_core_cannot_express_are_refused_with_the_reason(hf_copy, tmp_path, model_type,
                                                                                  reason):
    """Issue 26: Llama 4 is refused in one line naming the missing piece (README repeats it). (Qwen3-Next,
    once here, converts: tests/test_family_qwen3_next.py; Ministral 3 too, exactly up to its original context:
    tests/test_family_ministral3.py, whose guard is the query scale this file once checked.)"""
    src = hf_copy("llama")
    edit_config(src, model_type=model_type)
    convert_fails(src, tmp_path / "out", "^[^\n]*" + re.escape(f"model_type {model_type!r} is not supported: {reason}")
                  + "[^\n]*$")
