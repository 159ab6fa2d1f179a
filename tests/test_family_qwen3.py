"""Qwen3 (dense) as one family file, and the one ModelSpec -> megatron-core translation it rides on.

Round trips and logit parity for Qwen3 run with every family (tests/conftest.py VARIANTS); the
q/k-norm guard is in test_convert_parity.py."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from toolkit.families import FAMILIES, spec_from_config
from toolkit.layouts import Layout
from toolkit.megatron_settings import ARG_NAMES, MCORE_ROPE_SCALING_FACTOR, megatron_args, settings_for
from toolkit.tinymodels import make_config


def spec_of(variant: str):
    return spec_from_config(make_config(variant).to_dict())[1]


def test_unscaled_rope_factor_is_megatron_cores_default():
    """The model was built with 8.0 and the stored args said 1.0; both are megatron-core's default now."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    default = inspect.signature(GPTModel.__init__).parameters["rope_scaling_factor"].default
    spec = spec_of("qwen3")
    assert MCORE_ROPE_SCALING_FACTOR == default
    assert settings_for(spec).gpt["rope_scaling_factor"] == default
    assert megatron_args(spec, Layout(), "torch").rope_scaling_factor == default


@pytest.mark.parametrize("variant", ["llama3-scaled", "qwen2", "mistral", "qwen3-tied", "gemma3", "olmo2", "mixtral", "qwen3-moe",
                                     "gpt-oss"])
def test_stored_args_and_the_built_transformer_config_agree(variant):
    """Every TransformerConfig field Megatron-LM also keeps in `args` has the same value in both."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.model import transformer_config

    spec, layout = spec_of(variant), Layout(2, 2)
    config = transformer_config(spec, layout, getattr(torch, spec.dtype))
    args = megatron_args(spec, layout, "torch")
    compared = [f.name for f in dataclasses.fields(TransformerConfig) if hasattr(args, ARG_NAMES.get(f.name, f.name))]
    assert len(compared) >= 15, compared
    for name in compared:
        assert getattr(config, name) == getattr(args, ARG_NAMES.get(name, name)), name


def test_qwen3_settings_come_from_its_family_file():
    spec = spec_of("qwen3")
    args = megatron_args(spec, Layout(), "torch_dist")
    assert (spec.head_dim, spec.hidden_size // spec.num_heads) == (12, 5)
    assert (args.kv_channels, args.qk_layernorm, args.add_qkv_bias, args.num_query_groups) == (12, True, False, 2)
    assert settings_for(spec_of("llama")).transformer.get("qk_layernorm") is None


def test_unknown_model_type_lists_every_supported_family(hf_copy, tmp_path):
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(supported.split(", "))
    src = hf_copy("qwen3")
    edit_config(src, model_type="dbrx")
    convert_fails(src, tmp_path / "out", re.escape(f"model_type 'dbrx' is not supported (supported: {supported})"))


FULL = ["full_attention"] * 6


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"use_sliding_window": True, "sliding_window": 16}, "qwen3 with use_sliding_window=True cannot be mapped"),
        ({"layer_types": FULL[:5] + ["sliding_attention"]}, "qwen3 with layer_types[5]='sliding_attention' cannot be"),
        ({"attention_bias": True}, "qwen3 with attention_bias=True cannot be mapped"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
         "rope_parameters.rope_type='yarn': rope scaling type 'yarn' is not supported for qwen3"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
         "rope_parameters.rope_type='linear': rope scaling type 'linear' is not supported for qwen3"),
    ],
    ids=["sliding-window", "layer-types", "attention-bias", "yarn", "linear-rope"],
)
def test_unsupported_qwen3_variant_is_refused_in_one_line_naming_field_and_value(hf_copy, tmp_path, changes, line):
    src = hf_copy("qwen3")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")
