"""Families megatron-core 0.16.1 cannot express exactly (Gemma 3, OLMo 2) are refused with each
missing piece named, before anything is written (the pieces are read from its source, see
toolkit/families/__init__.py REFUSED)."""

from __future__ import annotations

import re

import pytest

from tests.test_convert_bad_input import convert_fails, edit_config
@pytest.mark.parametrize("model_type, piece", [("olmo2", "q/k norms over the whole projection"),
                                               ("gemma3_text", "no embedding scale by sqrt(hidden)")])
def test_families_megatron_core_cannot_express_are_refused_naming_the_missing_pieces(hf_copy, tmp_path, model_type,
                                                                                     piece):
    src = hf_copy("phi3")
    edit_config(src, model_type=model_type)
    convert_fails(src, tmp_path / "out", rf"^model_type '{model_type}' cannot be converted exactly: megatron-core 0\.16\.1 "
                                         rf"has no norm after attention and after the MLP.*{re.escape(piece)}[^\n]*$")
