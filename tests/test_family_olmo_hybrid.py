"""OLMo-Hybrid (olmo_hybrid): gated delta net layers with pre-norms, beta doubled and an output norm of eps 1e-5,
between OLMo 3's post-norm attention layers with q/k norms over the projection; RoPE on the attention layers or
none anywhere (toolkit/families/olmo_hybrid.py).

HF is the reference: megatron-core loading our checkpoints at TP2 x PP2 (both formats) gives HF's logits within
1e-4 in fp32 in the one launch of tests/test_published_parity.py, where three deliberately wrong conversions must
fail (`GUARDS`); the published config (tests/data/published_configs/olmo-hybrid-7b.json: no RoPE) verifies in
tests/test_published_configs.py's launch on 520 tokens, past the conv kernel (4) and HF's chunk of the gated
delta rule (64). The pieces no conversion can get wrong by a table (the output norm's eps, the norms' places)
have guards here on HF's own model."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config

VARIANT = "olmo-hybrid"


@pytest.fixture(scope="module")
def tiny_olmo_hybrid(tmp_path_factory):
    """`olmo-hybrid` fp32 (parity), `olmo-hybrid-bf16` (round trips in the HF dtype), as published
    (toolkit/tinymodels.py as_olmo_hybrid_publishes)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("olmo-hybrid"), (VARIANT,), 160, 170)


def test_settings_and_refusals():
    spec = spec_from_config(make_config(VARIANT).to_dict())[1]
    assert (spec.family, spec.linear_layers, spec.rope_theta, spec.qk_norm) == ("olmo_hybrid", "1010", 10000.0, True)
    assert spec.linear_attention == {"k_heads": 2, "v_heads": 4, "k_dim": 8, "v_dim": 12, "conv_kernel": 4,
                                     "beta_scale": 2.0, "out_norm_eps": 1e-5}
    settings = settings_for(spec)
    assert {k: settings.transformer[k] for k in ("linear_attention_freq", "qk_layernorm", "layernorm_epsilon")} == {
        "linear_attention_freq": [1, 0, 1, 0], "qk_layernorm": True, "layernorm_epsilon": 1e-6}
    assert settings.gpt["position_embedding_type"] == "rope"
    nope = spec_from_config(make_config(VARIANT, rope_parameters={"rope_theta": None}).to_dict())[1]
    assert nope.rope_theta is None and settings_for(nope).gpt["position_embedding_type"] == "none"
    plain = spec_from_config(make_config(VARIANT, linear_allow_neg_eigval=False).to_dict())[1]
    assert plain.linear_attention["beta_scale"] == 1.0
    for changes, line in (
            ({"layer_types": ["linear_attention", "sliding_attention"] * 2},
             r"olmo_hybrid with layer_types\[1\]='sliding_attention'"),
            ({"attention_bias": True}, "olmo_hybrid with attention_bias=True"),
            ({"linear_num_value_heads": 3}, "each key head serves whole value heads"),
            ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
             "rope scaling type 'linear' is not supported for olmo_hybrid")):
        with pytest.raises(ConversionError, match=line):
            spec_from_config(make_config(VARIANT, **changes).to_dict())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_round_trips_bit_exactly_and_loads_in_transformers(tiny_olmo_hybrid, tmp_path, fmt):
    """TP2 x PP2: every tensor back bit for bit under its published name (the six in_proj Linears and the three
    convs joined into megatron-core's in_proj and conv1d, and cut again), and transformers reads the export."""
    from transformers import AutoModelForCausalLM

    src = tiny_olmo_hybrid[f"{VARIANT}-bf16"]
    back = megatron_to_hf(hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, fmt=fmt, progress=False), tmp_path / "h",
                          progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.model.layers[0].linear_attn.conv1d.weight.shape == (2 * 16 + 48, 1, 4)


def hf_logits(src, edit=None):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if edit:
        edit(model)
    with torch.no_grad():
        return model(reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)).logits


def _gated_norm_eps_of_the_model(model):  # megatron-core's default: layernorm_epsilon (rms_norm_eps 1e-6)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.o_norm.variance_epsilon = model.config.rms_norm_eps


def _linear_layers_post_normed(model):  # OLMo 3's norm places on the gated delta net layers too
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            mixer, mlp, first, second = layer.linear_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm

            def forward(hidden_states, mixer=mixer, mlp=mlp, first=first, second=second, **kwargs):
                hidden_states = hidden_states + first(mixer(hidden_states))
                return hidden_states + second(mlp(hidden_states))

            layer.forward = forward


@pytest.mark.parametrize("edit", [_gated_norm_eps_of_the_model, _linear_layers_post_normed])
def test_guards_each_piece_moves_hf_logits_past_the_tolerance(tiny_olmo_hybrid, edit):
    """HF's own model with the gated norm's eps megatron-core would give it, or with the linear layers normed as
    the attention layers: each moves the logits more than 100x the parity tolerance."""
    change = (hf_logits(tiny_olmo_hybrid[VARIANT], edit) - hf_logits(tiny_olmo_hybrid[VARIANT])).abs().max().item()
    print(edit.__name__, f"{change:.2e}")
    assert change > 100 * FP32_TOLERANCE


# Deliberately wrong conversions, each compared with the model's own HF logits in the parity launch: beta not
# doubled (linear_allow_neg_eigval read as False), the output gate read as the values (g_proj and v_proj swapped
# into in_proj), no RoPE on the attention layers (rope_theta read as null)
GUARDS = ("beta-not-doubled", "gate-as-values", "no-rope")


def _wrong(models, tmp_path, piece: str):
    src = tmp_path / f"olmo-hybrid-{piece}"
    shutil.copytree(models[VARIANT], src)
    if piece == "beta-not-doubled":
        edit_config(src, linear_allow_neg_eigval=False)
    elif piece == "gate-as-values":
        def swap(tensors):
            for name in [n for n in tensors if n.endswith("linear_attn.g_proj.weight")]:
                values = name.replace("g_proj", "v_proj")
                tensors[name], tensors[values] = tensors[values], tensors[name]

        edit_tensors(src, swap)
    else:
        edit_config(src, rope_parameters={"rope_theta": None})
    return hf_to_megatron(src, tmp_path / f"m-olmo-hybrid-{piece}", tp=2, pp=2, progress=False)


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py (EP ranks as
    data-parallel ones): the model as per-rank torch files and as torch_dist, which must match, then one wrong
    conversion per GUARDS piece, which must not; and how many must match."""
    pairs = [(models[VARIANT], hf_to_megatron(models[VARIANT], tmp_path / f"olmo-hybrid-{fmt}", tp=2, pp=2, fmt=fmt,
                                               progress=False)) for fmt in ("torch", "torch_dist")]
    return pairs + [(models[VARIANT], _wrong(models, tmp_path, piece)) for piece in GUARDS], len(pairs)


def assert_guards_fail(reports) -> None:
    print({piece: f"{r.max_logit_diff:.2e}" for piece, r in zip(GUARDS, reports)})
    for piece, report in zip(GUARDS, reports, strict=True):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


def test_the_gated_delta_nets_output_norm_is_summed_over_tp():
    """GatedDeltaNet.out_norm holds one weight of head_v_dim that each TP rank applies to its own value heads: its
    gradient is partial per rank and summed over TP (toolkit/train/parallel.py), as the q/k norms'. Without the sum
    OLMo-Hybrid's TP2 x PP2 fine-tune drifted from HF's (losses 3.0e-3 apart at init std 0.1)."""
    from types import SimpleNamespace

    from toolkit.train.parallel import partial_over_tp

    config = SimpleNamespace(sequence_parallel=False, qk_layernorm=False)
    weight = torch.nn.Parameter(torch.ones(12))
    assert partial_over_tp(config, "decoder.layers.0.self_attention.out_norm.weight", weight)
    assert not partial_over_tp(config, "decoder.layers.0.self_attention.in_proj.layer_norm_weight", weight)
