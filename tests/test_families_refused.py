"""A model_type that names a known model the toolkit cannot convert is refused with the reason,
before anything is written (toolkit/families/__init__.py REFUSED)."""

from __future__ import annotations

import re

from tests.test_convert_bad_input import convert_fails, edit_config


def test_multimodal_gemma3_is_refused_pointing_at_its_text_model(hf_copy, tmp_path):
    src = hf_copy("gemma3")
    edit_config(src, model_type="gemma3")
    convert_fails(src, tmp_path / "out", "^" + re.escape("model_type 'gemma3' is not supported: the multimodal Gemma 3 "
                                                         "(Gemma3ForConditionalGeneration): convert its text model") + "[^\n]*$")
