"""A model_type that names a known model the toolkit cannot read as published is refused with the
reason, before anything is written."""

from __future__ import annotations

import re

from tests.test_convert_bad_input import convert_fails, edit_config


def test_multimodal_gemma3_without_its_text_config_is_refused_in_one_line(hf_copy, tmp_path):
    """model_type gemma3 is the multimodal wrapper (tests/test_gemma3_wrapper.py): its language
    model's config is `text_config`, which a text model relabelled gemma3 lacks."""
    src = hf_copy("gemma3")
    edit_config(src, model_type="gemma3")
    convert_fails(src, tmp_path / "out", "^[^\n]*" + re.escape("config.json: model_type 'gemma3' without a 'text_config' "
                                                              "object: not a multimodal checkpoint") + "[^\n]*$")

# (Llama 4, Qwen3-Next and Ministral 3, once refused here, convert: tests/test_family_llama4.py,
# tests/test_family_qwen3_next.py, tests/test_family_ministral3.py, which holds the query-scale check this file once had.)
