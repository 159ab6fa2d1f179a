"""Phi-3 / Phi-4-mini as one family file: HF's fused qkv_proj / gate_up_proj re-split per query
group and per TP rank, and Phi-4-mini's partial rotary as megatron-core's rotary_percent (round
trips and logit parity run with every family, tests/conftest.py VARIANTS, Phi-3 with one KV head
at TP 2 too; LongRoPE in tests/test_longrope.py); the variants megatron-core 0.16.1 cannot express
exactly are refused in one line."""

from __future__ import annotations

import inspect
import re

import pytest

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE, logit_change
from tests.test_family_qwen3 import spec_of
from toolkit.layouts import Layout
from toolkit.megatron_settings import megatron_args, settings_for


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
         "refused by transformers' Phi3Config: Class validation error for validator 'validate_rope': ValueError: "
         "`rope_parameters`'s type field must be one of ['longrope'], got dynamic"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0}},
         "partial_rotary_factor=0 is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
    ids=["dynamic-rope", "no-rotary", "activation"],
)
def test_unsupported_phi3_variant_is_refused_in_one_line(hf_copy, tmp_path, changes, line):
    src = hf_copy("phi3")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")


def test_phi3_window_changes_the_model_so_parity_proves_it(tiny_hf):
    """The tiny Phi-3's window (8) is shorter than the parity sequences (32)."""
    assert logit_change(tiny_hf["phi3"], sliding_window=None) > 100 * FP32_TOLERANCE


def test_partial_rotary_is_refused_where_the_family_rotates_whole_heads(hf_copy, tmp_path):
    """HF Llama / Qwen rotate every dimension whatever the config says, so the factor is refused."""
    src = hf_copy("qwen3")
    edit_config(src, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    convert_fails(src, tmp_path / "out", re.escape("partial_rotary_factor=0.5 is not supported for qwen3 (only 1.0)"))


def test_phi4_mini_partial_rotary_reaches_megatron_core_and_the_stored_args():
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = spec_of("phi4-mini")
    assert (spec.rotary_percent, spec.head_dim, spec.tied_embeddings) == (0.75, 16, True)
    assert settings_for(spec).gpt["rotary_percent"] == 0.75
    assert megatron_args(spec, Layout(2, 2), "torch_dist").rotary_percent == 0.75
    assert megatron_args(spec_of("phi3"), Layout(), "torch").rotary_percent == 1.0
    assert "rotary_percent" in inspect.signature(GPTModel.__init__).parameters


def test_phi4_mini_partial_rotary_changes_the_model_so_parity_proves_it(tiny_hf):
    """RoPE over whole heads (partial_rotary_factor 1.0), the same weights otherwise, moves the
    logits far past the tolerance: a model built without rotary_percent fails parity."""
    from transformers import AutoConfig

    src = tiny_hf["phi4-mini"]
    full = dict(AutoConfig.from_pretrained(src).rope_parameters, partial_rotary_factor=1.0)
    assert AutoConfig.from_pretrained(src, rope_parameters=full).rope_parameters["partial_rotary_factor"] == 1.0
    assert logit_change(src, rope_parameters=full) > 100 * FP32_TOLERANCE


@pytest.mark.parametrize("hidden", [192, 144], ids=["head16-rotates-12", "head12-rotates-10-of-int-9"])
def test_rotated_dims_agree_in_hf_megatron_core_and_the_memory_estimate(hidden):
    """The same frequencies on both sides (also where int(head_dim * factor) is odd), and the
    estimate's cos / sin width (ModelSpec.rotary_dim) is theirs."""
    import dataclasses

    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from toolkit.families import spec_from_config
    from toolkit.tinymodels import make_config

    config = make_config("phi4-mini", hidden_size=hidden)
    spec = spec_from_config(config.to_dict())[1]
    hf_freqs, _ = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
    ours = RotaryEmbedding(kv_channels=spec.head_dim, rotary_percent=spec.rotary_percent, rotary_base=spec.rope_theta,
                           use_cpu_initialization=True).inv_freq
    assert torch.equal(hf_freqs, ours)
    assert spec.rotary_dim == 2 * ours.numel() < spec.head_dim
    assert dataclasses.replace(spec, rotary_percent=1.0).rotary_dim == spec.head_dim


# microsoft/Phi-4-mini-instruct's config.json, the fields the estimate reads (its LongRoPE, which
# adds no parameters, left out), and the parameter count of its published safetensors.
PHI4_MINI_SHAPE = dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                       partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=262144)
PHI4_MINI_PARAMETERS = 3_836_021_760


def test_memory_counts_phi4_minis_published_parameters_from_the_family_table():
    from toolkit.families import spec_from_config
    from toolkit.memory.params import stage_param_numels, total_params

    spec = spec_from_config(PHI4_MINI_SHAPE)[1]
    assert (spec.rotary_dim, spec.head_dim) == (96, 128)
    assert total_params(spec) == PHI4_MINI_PARAMETERS
    # TP 1 x PP 1 holds them all, the vocab padded to a multiple of 128 (200064 already is)
    assert sum(stage_param_numels(spec, 1, 1, 0)) == PHI4_MINI_PARAMETERS
