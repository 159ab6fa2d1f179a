"""Gemma 3 (text) as one family file over the toolkit's block spec. Round trips, logit parity at
every layout (TP 2 and 4 with its one KV head) and megatron-core's own loader run with every family
(tests/conftest.py VARIANTS); here: each Gemma-specific piece moves the logits far past the parity
tolerance when switched off (so parity proves it is converted and built), the settings it
translates to, and the variants refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_qwen3 import spec_of
from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens
from toolkit.layouts import Layout
from toolkit.megatron_settings import megatron_args, settings_for


def logits_without(hf_dir, switch_off) -> float:
    """Max |logit change| on the parity tokens when `switch_off(model)` removes one feature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        before = model(tokens).logits
        switch_off(model)
        return (model(tokens).logits - before).abs().max().item()


def _norms(model):
    return [m for n, m in model.named_modules() if type(m).__name__ == "Gemma3RMSNorm"]


def _no_offset(model):
    """Every norm computes w instead of 1 + w (as a model built without layernorm_zero_centered_gamma)."""
    for norm in _norms(model):
        norm.weight -= 1.0


def _no_embedding_scale(model):
    model.model.embed_tokens.embed_scale.fill_(1.0)


def _no_post_norms(model):
    for layer in model.model.layers:
        layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()


def _global_rope_on_local_layers(model):
    rope = model.model.rotary_emb
    rope.sliding_attention_inv_freq = rope.full_attention_inv_freq.clone()


def _window_on_every_layer(model):
    model.config.layer_types = ["sliding_attention"] * len(model.model.layers)
    for layer in model.model.layers:
        layer.self_attn.sliding_window, layer.self_attn.layer_type = model.config.sliding_window, "sliding_attention"


def _head_dim_softmax_scale(model):
    for layer in model.model.layers:
        layer.self_attn.scaling = layer.self_attn.head_dim**-0.5


def _silu_not_gelu(model):
    """The GeGLU of Gemma as a SwiGLU (the shared activation of every other family)."""
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.SiLU()


@pytest.mark.parametrize(
    "switch_off",
    [_no_offset, _no_embedding_scale, _no_post_norms, _global_rope_on_local_layers, _window_on_every_layer,
     _head_dim_softmax_scale, _silu_not_gelu],
    ids=["1+w-offset", "embedding-scale", "post-norms", "local-rope-base", "window-pattern", "query-pre-attn-scalar",
         "gelu-tanh"],
)
def test_each_gemma3_piece_changes_the_model_so_parity_proves_it(tiny_hf, switch_off):
    assert logits_without(tiny_hf["gemma3-fp32"], switch_off) > 100 * FP32_TOLERANCE


def test_gemma3_settings_come_from_its_family_file():
    spec = spec_of("gemma3")
    transformer, gpt = settings_for(spec).transformer, settings_for(spec).gpt
    assert spec.window_layers == "110110" and transformer["window_attn_skip_freq"] == [1, 1, 0, 1, 1, 0]
    assert (spec.window_rope_theta, gpt["rotary_base"], gpt["seq_len_interpolation_factor"]) == (1e4, 1e6, 8.0)
    assert transformer["softmax_scale"] == 20**-0.5 and transformer["window_size"] == (7, 0)
    assert transformer["layernorm_zero_centered_gamma"] and transformer["qk_layernorm"]
    assert transformer["activation_func"](torch.tensor([1.0])) == torch.nn.functional.gelu(torch.tensor([1.0]),
                                                                                         approximate="tanh")
    args = megatron_args(spec, Layout(), "torch_dist")
    assert (args.apply_layernorm_1p, args.gated_linear_unit, args.activation) == (True, True, "gelu_pytorch_tanh")
    assert not hasattr(args, "swiglu")  # Megatron-LM's swiglu means a gated silu


def test_legacy_gemma3_config_keys_read_the_same(tmp_path):
    """transformers 4 configs: rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern."""
    from toolkit.families import spec_from_config
    from toolkit.tinymodels import make_config

    cfg = make_config("gemma3").to_dict()
    legacy = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  sliding_window_pattern=3)
    assert spec_from_config(legacy)[1] == spec_from_config(cfg)[1]


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"attn_logit_softcapping": 50.0}, "gemma3 with attn_logit_softcapping=50.0 cannot be mapped exactly"),
        ({"final_logit_softcapping": 30.0}, "gemma3 with final_logit_softcapping=30.0 cannot be mapped exactly"),
        ({"use_bidirectional_attention": True}, "gemma3 with use_bidirectional_attention=True cannot be mapped"),
        ({"attention_bias": True}, "gemma3 with attention_bias=True cannot be mapped"),
        ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]},
         "gemma3 with layer_types[5]='chunked_attention' cannot be mapped exactly"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported for gemma3"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters.full_attention.factor=3.0: linear rope scaling is exact in megatron-core only for a "
         "power-of-two factor"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters.full_attention.rope_type='yarn': rope scaling type 'yarn' is not supported for gemma3"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "rope_parameters.sliding_attention.rope_type='linear': only the default RoPE on gemma3's local layers"),
    ],
    ids=["attn-softcap", "final-softcap", "bidirectional", "attention-bias", "layer-type", "activation",
         "linear-factor-3", "yarn", "local-linear"],
)
def test_unsupported_gemma3_variant_is_refused_in_one_line_naming_field_and_value(hf_copy, tmp_path, changes, line):
    src = hf_copy("gemma3")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")
