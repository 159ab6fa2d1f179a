"""OLMo 3 as one family file over OLMo 2's layer and Gemma 3's per-layer RoPE (toolkit/families/olmo3.py).
Round trips, logit parity at every layout and megatron-core's loader run with every family (tests/conftest.py
VARIANTS); its fine-tune in tests/test_finetune_parity.py; the published 7B and 32B in the corpus
(tests/test_published_configs.py). Here: each OLMo 3 piece moves HF's own logits far past the parity
tolerance when switched off, the way config.json is read, and the variants refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_gemma3 import logits_without
from tests.test_family_olmo2 import _no_post_norms, _per_head_qk_norm
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "olmo3"


@pytest.fixture(scope="module")
def olmo3_fp32(tmp_path_factory):
    return make_tiny_model(VARIANT, tmp_path_factory.mktemp("olmo3") / "fp32", dtype="float32", seed=5)


def _yarn_on_every_layer(model):
    """transformers 5.2's regression: the windowed layers get the full-attention layers' YaRN RoPE (its
    attention factor included) instead of their own plain one."""
    rotary = model.model.rotary_emb
    forward = rotary.forward
    rotary.forward = lambda x, position_ids, layer_type: forward(x, position_ids, "full_attention")


def _windowed_layers_with_the_full_layers_base(model):
    """The windowed layers' RoPE of the full-attention layers' base (no YaRN): their own base matters."""
    rotary = model.model.rotary_emb
    theta = model.config.rope_parameters["full_attention"]["rope_theta"]
    dim = rotary.sliding_attention_inv_freq.numel() * 2
    rotary.sliding_attention_inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _no_yarn_attention_factor(model):
    """YaRN's frequencies on the full-attention layers without its factor on cos and sin."""
    model.model.rotary_emb.full_attention_attention_scaling = 1.0


def _no_window(model):
    model.config.sliding_window = 10**6  # every windowed layer's mask as the full ones'


GUARDS = [_yarn_on_every_layer, _windowed_layers_with_the_full_layers_base, _no_yarn_attention_factor, _no_window,
          _no_post_norms, _per_head_qk_norm]


@pytest.mark.parametrize("switch_off", GUARDS, ids=lambda f: f.__name__.strip("_"))
def test_each_olmo3_piece_changes_the_model_so_parity_proves_it(olmo3_fp32, switch_off):
    assert logits_without(olmo3_fp32, switch_off) > 100 * FP32_TOLERANCE


def test_yarn_is_the_full_layers_rope_and_the_windowed_layers_keep_their_own():
    """As Olmo3Config resolves it (a transformers 4 file's rope_scaling goes to the full-attention layers only):
    GPTModel's RoPE is YaRN, each windowed layer builds a plain one of the sliding_attention base."""
    published = {"model_type": "olmo3", "num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 256, "rope_theta": 500000.0,
                 "max_position_embeddings": 65536, "sliding_window": 4096,
                 "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "yarn"}}
    spec = spec_from_config(published)[1]
    assert (spec.window_layers, spec.window_size) == ("11101110", 4096)  # Olmo3Config's default: every 4th full
    assert (spec.rope_theta, spec.window_rope_theta) == (500000.0, 500000.0)
    assert spec.yarn["yarn_rotary_scaling_factor"] == 8.0 and spec.yarn["yarn_original_max_position_embeddings"] == 8192
    settings = settings_for(spec)
    assert settings.gpt["position_embedding_type"] == "yarn"
    assert settings.transformer["window_attn_skip_freq"] == [1, 1, 1, 0, 1, 1, 1, 0]
    from toolkit.blocks.decoder_spec import rope_bases

    assert rope_bases(spec) == (500000.0, 500000.0, 500000.0, None) * 2


def test_a_windowed_layer_with_its_own_rope_takes_no_yarn_attention_factor():
    """megatron-core applies the YaRN factor in every layer from the config (0.16.1 in forward, 0.19 cached at
    init): the windowed layers' attention reads a config without the yarn_* attributes, the full ones' the model's."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    from toolkit.blocks.rope_yarn import without_yarn
    from toolkit.layouts import Layout
    from toolkit.model import transformer_config

    spec = spec_from_config(make_config(VARIANT).to_dict())[1]
    config = transformer_config(spec, Layout(1, 1), layer_spec="local")
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(1 + 0.1 * torch.log(torch.tensor(4.0)).item())
    plain = without_yarn(config)
    assert _yarn_get_concentration_factor_from_config(plain) == 1.0
    assert hasattr(config, "yarn_rotary_scaling_factor")  # the model's own config keeps them
    assert {k: v for k, v in vars(plain).items()} == {k: v for k, v in vars(config).items() if not k.startswith("yarn_")}


YARN_FULL = make_config(VARIANT).rope_parameters["full_attention"]


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"attention_bias": True}, "olmo3 with attention_bias=True cannot be mapped"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 3},
         "olmo3 with layer_types[1]='chunked_attention' cannot be mapped exactly"),
        ({"rope_parameters": {"full_attention": YARN_FULL,
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "rope_parameters.sliding_attention.rope_type='linear': only the default RoPE on olmo3's local layers"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters.full_attention.rope_type='linear': rope scaling type 'linear' is not supported for olmo3"),
        ({"rope_parameters": {"full_attention": {**YARN_FULL, "attention_factor": 1.5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "rope_parameters.full_attention.attention_factor=1.5: an explicit YaRN attention factor other than the one "
         "derived"),
    ],
    ids=["attention-bias", "layer-type", "sliding-rope-type", "full-rope-type", "attention-factor"],
)
def test_unsupported_olmo3_variant_is_refused_in_one_line_naming_field_and_value(tmp_path, changes, line):
    src = make_tiny_model(VARIANT, tmp_path / "src", dtype="bfloat16")
    edit_config(src, **changes)
    # transformers 5.17's Olmo3Config refuses the unknown layer type itself, naming it ("...: 'chunked_attention'")
    first = "|Olmo3Config: 'chunked_attention'" if "layer_types" in changes else ""
    convert_fails(src, tmp_path / "out", r"^[^\n]*(" + re.escape(line) + first + r")[^\n]*$")


def test_the_published_attention_factor_is_the_one_megatron_core_derives():
    """OLMo 3 writes 1.2079441541679836: bit for bit megatron-core's _yarn_get_mscale(8.0), so it is accepted;
    any other value is refused (above)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    assert _yarn_get_concentration_factor(8.0, None, None) == 1.2079441541679836
    with pytest.raises(ConversionError, match="attention_factor=1.3"):
        spec_from_config(make_config(VARIANT, rope_parameters={
            "full_attention": {**YARN_FULL, "attention_factor": 1.3},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict())


def published_size_counts(name: str) -> tuple[int, int]:
    """(`toolkit memory`'s parameter count of corpus entry `name` at its published sizes, HF's model of those
    sizes built on the meta device)."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import total_params

    cfg = {**corpus.config(name), **corpus.index()[name]["original_sizes"]}
    config = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return total_params(spec_from_config(cfg)[1]), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, billions", [("olmo-3-7b", 7), ("olmo-3.1-32b-think", 32)])
def test_published_sizes_count_as_hf_builds_them(name, billions):
    ours, hf = published_size_counts(name)
    assert ours == hf and int(ours / 1e9) == billions
