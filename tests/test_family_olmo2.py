"""OLMo 2 as one family file over the toolkit's block spec. Round trips, logit parity at every
layout (TP 4 with its 2 KV heads: the whole-projection k norm then spans replicated heads) and
megatron-core's own loader run with every family (tests/conftest.py VARIANTS); here: each
OLMo-specific piece moves the logits far past the parity tolerance when switched off, and the
variants refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_gemma3 import logits_without


def _no_post_norms(model):
    for layer in model.model.layers:
        layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()


class PerHead(torch.nn.Module):
    """The same norm weights applied per head, as megatron-core's stock qk_layernorm normalises."""

    def __init__(self, norm, head_dim):
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, x):
        heads = x.unflatten(-1, (-1, self.head_dim)).float()
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        return (normed.flatten(-2) * self.norm.weight).to(x.dtype)


def _per_head_qk_norm(model):
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = PerHead(attn.q_norm, attn.head_dim), PerHead(attn.k_norm, attn.head_dim)


@pytest.mark.parametrize("switch_off", [_no_post_norms, _per_head_qk_norm], ids=["post-norms", "whole-projection-qk-norm"])
def test_each_olmo2_piece_changes_the_model_so_parity_proves_it(tiny_hf, switch_off):
    assert logits_without(tiny_hf["olmo2-fp32"], switch_off) > 100 * FP32_TOLERANCE


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"attention_bias": True}, "olmo2 with attention_bias=True cannot be mapped"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for olmo2"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
         "rope_parameters.rope_type='yarn': rope scaling type 'yarn' is not supported for olmo2"),
    ],
    ids=["attention-bias", "activation", "yarn"],
)
def test_unsupported_olmo2_variant_is_refused_in_one_line_naming_field_and_value(hf_copy, tmp_path, changes, line):
    src = hf_copy("olmo2")
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", r"^[^\n]*" + re.escape(line) + r"[^\n]*$")
