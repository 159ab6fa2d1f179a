"""Phi-3 as one family file: HF's fused qkv_proj / gate_up_proj re-split per query group and per
TP rank (round trips and logit parity run with every family, tests/conftest.py VARIANTS); the
variants megatron-core 0.16.1 cannot express exactly are refused in one line."""

from __future__ import annotations

import re

import pytest

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE, logit_change

LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"rope_parameters": LONGROPE}, "rope_parameters.rope_type='longrope': rope scaling type 'longrope' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
         "partial_rotary_factor=0.75 is not supported (only 1.0)"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
    ids=["longrope", "partial-rotary", "activation"],
)
def test_unsupported_phi3_variant_is_refused_in_one_line(hf_copy, tmp_path, changes, line):
    src = hf_copy("phi3")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")


def test_phi3_window_changes_the_model_so_parity_proves_it(tiny_hf):
    """The tiny Phi-3's window (8) is shorter than the parity sequences (32)."""
    assert logit_change(tiny_hf["phi3"], sliding_window=None) > 100 * FP32_TOLERANCE

