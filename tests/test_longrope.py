"""LongRoPE (Phi-3.5-mini, Phi-4-mini, the Phi-3 128k models) as transformers 5.23 computes it: the
parameters read as HF reads them (published config.json styles included), the frequencies and the
switch from short to long factors past original_max_position_embeddings the same floats as HF's,
and each piece guarded: the tiny models' logits move far past the parity tolerance without it.
Logit parity at TP2 x PP2 runs in tests/test_published_parity.py (one launch with the other
pieces of issue 24)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE, logit_change
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.families import spec_from_config
from toolkit.blocks.rope_longrope import LongRopeEmbedding, inverse_frequencies
from toolkit.tinymodels import make_config, make_tiny_model

LONGROPE_VARIANTS = ("phi3-longrope", "phi4-mini-longrope")


@pytest.fixture(scope="module")
def longrope_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("longrope")
    return {v: make_tiny_model(v, root / v, dtype="float32", seed=60 + i) for i, v in enumerate(LONGROPE_VARIANTS)}


def published_style(variant: str, **top_level) -> dict:
    """The tiny config as Phi-3.5-mini / Phi-4-mini publish theirs (transformers 4: `rope_scaling`
    with `type`, theta and the partial factor at the top level)."""
    cfg = make_config(variant).to_dict()
    params = cfg.pop("rope_parameters")
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": params["short_factor"], "long_factor": params["long_factor"]}
    cfg.update(rope_theta=params["rope_theta"], partial_rotary_factor=params.get("partial_rotary_factor", 1.0), **top_level)
    return {k: v for k, v in cfg.items() if v is not None}


def hf_rotary(cfg: dict):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    return Phi3RotaryEmbedding(Phi3Config.from_dict(cfg))


CASES = {
    "saved-by-transformers-5": lambda: make_config("phi3-longrope").to_dict(),
    "published-rope_scaling": lambda: published_style("phi4-mini-longrope"),
    # Phi-3.5-mini's sizes: 4096 pretraining positions of 131072, attention factor 1.19
    "published-128k": lambda: published_style("phi3-longrope", max_position_embeddings=131072,
                                              original_max_position_embeddings=4096),
    # only in rope_scaling: transformers' Phi3Config ignores it for its own top-level default, 4096
    "original-max-only-in-rope_scaling": lambda: published_style(
        "phi3-longrope", original_max_position_embeddings=None) | {"rope_scaling": {
            **published_style("phi3-longrope")["rope_scaling"], "original_max_position_embeddings": 16}},
    "explicit-attention_factor": lambda: published_style("phi3-longrope") | {"rope_scaling": {
        **published_style("phi3-longrope")["rope_scaling"], "attention_factor": 1.5}},
}


@pytest.mark.parametrize("case", CASES)
def test_longrope_parameters_and_frequencies_are_transformers_own(case):
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    cfg = CASES[case]()
    spec = spec_from_config(cfg)[1]
    hf = hf_rotary(cfg)
    original = spec.longrope["original_max_position_embeddings"]
    assert original == hf.config.rope_parameters["original_max_position_embeddings"]
    assert spec.longrope["attention_factor"] == hf.attention_scaling
    dim = int(spec.head_dim * spec.rotary_percent)
    assert torch.equal(inverse_frequencies(spec.longrope["short_factor"], spec.rope_theta, dim), hf.original_inv_freq)
    long, _ = _compute_longrope_parameters(Phi3Config.from_dict(cfg), seq_len=original + 1)
    assert torch.equal(inverse_frequencies(spec.longrope["long_factor"], spec.rope_theta, dim), long)


@pytest.mark.parametrize("case", ["saved-by-transformers-5", "published-rope_scaling"])
def test_factors_switch_where_transformers_switches(case):
    """cos and sin (times the attention factor, as HF applies it) at original_max_position_embeddings
    tokens (short factors) and one more (long factors, on every position). The angles as
    RotaryEmbedding.get_emb lays them out (its forward moves them to CUDA)."""
    cfg = CASES[case]()
    spec = spec_from_config(cfg)[1]
    ours = LongRopeEmbedding(spec.head_dim, spec.rotary_percent, spec.rope_theta, spec.longrope, True)
    original = spec.longrope["original_max_position_embeddings"]
    for seq in (original, original + 1):
        hf = hf_rotary(cfg)  # fresh: HF keeps the last inv_freq it switched to
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), torch.arange(seq)[None])
        half = ours.get_freqs_non_repeated(seq)
        angles = torch.cat((half, half), dim=-1)
        scale = spec.longrope["attention_factor"]
        assert torch.allclose(angles.cos() * scale, cos[0], rtol=0, atol=1e-6), seq
        assert torch.allclose(angles.sin() * scale, sin[0], rtol=0, atol=1e-6), seq
    assert not torch.allclose(ours.get_freqs_non_repeated(original)[1:], ours.get_freqs_non_repeated(original + 1)[1:-1])


def test_each_longrope_piece_changes_the_model_so_parity_proves_it(longrope_hf):
    """The parity sequences (32 tokens) pass Phi-3's switch point (16) and stay below Phi-4-mini's
    (48): long factors, short factors and the attention factor each move the logits."""
    phi3, phi4 = longrope_hf["phi3-longrope"], longrope_hf["phi4-mini-longrope"]
    p3 = json.loads((phi3 / "config.json").read_text())["rope_parameters"]
    p4 = json.loads((phi4 / "config.json").read_text())["rope_parameters"]
    changes = {
        "long factors": logit_change(phi3, rope_parameters={**p3, "long_factor": p3["short_factor"]}),
        "attention factor": logit_change(phi3, rope_parameters={**p3, "attention_factor": 1.0}),
        "short factors": logit_change(phi4, rope_parameters={**p4, "short_factor": p4["long_factor"]}),
    }
    assert min(changes.values()) > 100 * FP32_TOLERANCE, changes


def test_published_longrope_converts_and_exports_bit_exact(longrope_hf, tmp_path):
    """Phi-4-mini's config.json as published (transformers 4 keys) converts at TP2 x PP2 and exports
    back to the same tensors and a config transformers loads with the same LongRoPE."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "published"
    src.mkdir()
    for f in longrope_hf["phi4-mini-longrope"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(json.dumps(published_style("phi4-mini-longrope")))
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, fmt="torch", progress=False)
    spec = CheckpointMeta.read(out).model_spec
    assert spec.longrope["original_max_position_embeddings"] == 48 and spec.rotary_percent == 0.75
    back = megatron_to_hf(out, tmp_path / "hf", progress=False)
    original, restored = load_all(src), load_all(back)
    assert set(original) == set(restored) and all(torch.equal(original[k], restored[k]) for k in original)
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(1 + math.log(128 / 48) / math.log(48)))


@pytest.mark.parametrize(
    "changes, line",
    # transformers' Phi3Config refuses the first two itself (its words); a zero factor only the toolkit
    [({"short_factor": [1.0] * 3}, "Phi3Config: Class validation error for validator 'validate_rope': ValueError: "
                                   "`rope_parameters`'s short_factor field must have length 4, got 3"),
     ({"long_factor": "2.0"}, "`rope_parameters`'s long_factor field must be a list of numbers, got 2.0"),
     ({"long_factor": [1.0, 0.0, 2.0, 3.0]}, "LongRoPE needs a list of positive numbers")],
    ids=["short-count", "long-not-a-list", "zero-factor"],
)
def test_bad_longrope_is_refused_in_one_line(longrope_hf, tmp_path, changes, line):
    import re
    import shutil

    src = tmp_path / "src"
    shutil.copytree(longrope_hf["phi3-longrope"], src)
    params = json.loads((src / "config.json").read_text())["rope_parameters"]
    edit_config(src, rope_parameters={**params, **changes})
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")
