"""SmolLM3 as Llama's table with megatron-core's own per-layer RoPE skip (no_rope_freq; toolkit/families/
smollm3.py). Round trips, logit parity at every layout and megatron-core's loader run with every family
(tests/conftest.py VARIANTS); its fine-tune in tests/test_finetune_parity.py; the published 3B in the corpus
(tests/test_published_configs.py). Here: the NoPE layers move HF's own logits far past the parity tolerance
when given RoPE (and RoPE when dropped everywhere), no_rope_layers read as SmolLM3Config resolves it, and the
variants refused in one line."""

from __future__ import annotations

import re

import pytest

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_gemma3 import logits_without
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "smollm3"


@pytest.fixture(scope="module")
def smollm3_fp32(tmp_path_factory):
    return make_tiny_model(VARIANT, tmp_path_factory.mktemp("smollm3") / "fp32", dtype="float32", seed=6)


def _rope_on_every_layer(model):
    for layer in model.model.layers:
        layer.self_attn.use_rope = 1


def _rope_on_no_layer(model):
    for layer in model.model.layers:
        layer.self_attn.use_rope = 0


@pytest.mark.parametrize("switch_off", [_rope_on_every_layer, _rope_on_no_layer], ids=["nope-layers", "rope-layers"])
def test_each_smollm3_piece_changes_the_model_so_parity_proves_it(smollm3_fp32, switch_off):
    assert logits_without(smollm3_fp32, switch_off) > 100 * FP32_TOLERANCE


def test_no_rope_layers_read_as_smollm3config_resolves_them():
    """From no_rope_layer_interval where the file has no list (the tiny model: every 3rd layer NoPE), the
    list's first num_hidden_layers entries where it is longer (SmolLM3Config takes one at least that long),
    as megatron-core's no_rope_freq (1 where RoPE is skipped); none where every layer has RoPE."""
    spec = spec_from_config(make_config(VARIANT).to_dict())[1]
    assert spec.nope_layers == "001001"
    assert settings_for(spec).transformer["no_rope_freq"] == [0, 0, 1, 0, 0, 1]
    longer = make_config(VARIANT, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0]).to_dict()
    assert spec_from_config(longer)[1].nope_layers == "0001"
    every = spec_from_config(make_config(VARIANT, no_rope_layers=[1] * 6).to_dict())[1]
    assert every.nope_layers is None and "no_rope_freq" not in settings_for(every).transformer


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"attention_bias": True}, "smollm3 with attention_bias=True cannot be mapped"),
        ({"mlp_bias": True}, "smollm3 with mlp_bias=True cannot be mapped"),
        ({"use_sliding_window": True, "sliding_window": 8}, "smollm3 with use_sliding_window=True cannot be mapped"),
        ({"no_rope_layers": [1, 1, 2, 1, 1, 0]}, "smollm3 with no_rope_layers[2]=2 cannot be mapped exactly"),
        ({"layer_types": ["full_attention"] * 5 + ["sliding_attention"]},
         "smollm3 with layer_types[5]='sliding_attention' cannot be mapped exactly"),
    ],
    ids=["attention-bias", "mlp-bias", "sliding-window", "no-rope-flag", "layer-type"],
)
def test_unsupported_smollm3_variant_is_refused_in_one_line_naming_field_and_value(tmp_path, changes, line):
    src = make_tiny_model(VARIANT, tmp_path / "src", dtype="bfloat16")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")


def test_published_size_counts_as_hf_builds_it():
    """SmolLM3-3B: 3.08B with its tied embeddings, as HF builds it and `toolkit memory` counts it."""
    from tests.test_family_olmo3 import published_size_counts

    ours, hf = published_size_counts("smollm3-3b")
    assert ours == hf and round(ours / 1e9, 1) == 3.1
