"""Checkpoints as published (issue 24), converted at TP2 x PP2 and compared with HF's logits in one
launch, since process start-up dominates: LongRoPE past and before its switch point (Phi-3,
Phi-4-mini)."""

from __future__ import annotations

import pytest

from tests.test_convert_parity import assert_parity
from tests.test_longrope import longrope_hf  # noqa: F401  (a fixture)
from toolkit.convert import hf_to_megatron
from toolkit.convert.parity import verify_many


@pytest.mark.multiprocess
def test_published_variants_match_hf_at_tp2_pp2(longrope_hf, tmp_path):  # noqa: F811
    pairs = [(src, hf_to_megatron(src, tmp_path / f"{name}-{fmt}", tp=2, pp=2, fmt=fmt, progress=False))
             for (name, src), fmt in zip(longrope_hf.items(), ("torch", "torch_dist"))]
    assert_parity(verify_many(pairs, tp=2, pp=2))
