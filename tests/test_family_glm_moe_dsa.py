"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's mapping (tests/test_family_deepseek_v32.py) with its indexer's RoPE interleaved
and its latent norms at HF's 1e-6 under rms_norm_eps 1e-5 (toolkit/families/glm_moe_dsa.py).

HF is the reference: the indexer keeps GlmMoeDsaIndexer's top-k keys for every query (guard: its RoPE half-split as
DeepSeek-V3.2's keeps others); the model at TP2 x PP2 x EP2 in both formats gives HF's logits within 1e-4 in fp32 (in
the one launch of tests/test_published_parity.py, index_topk 8 of 32 tokens; its indexer guards are DeepSeek-V3.2's,
the same modules), on a model whose latents are small enough that the latent norms at 1e-5 would be 0.82 off."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import convert_fails, edit_tensors
from tests.test_family_deepseek_v32 import assert_round_trip, indexer_against_hf, world_of_one  # noqa: F401  (fixture)
from tests.test_family_glm4_moe import family_parity_pairs
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "glm-moe-dsa"
LOCAL = {"layer_spec": "local", "progress": False}


# The q and kv latents scaled by this before their norms (which undo it but for eps): at 1e-5 in those norms instead of
# HF's 1e-6 the fp32 model's logits are then 0.82 off HF's (9.5e-7 as converted), not the 8e-5 of the unscaled model
LATENT_SCALE = 0.02


@pytest.fixture(scope="module")
def tiny_glm_moe_dsa(tmp_path_factory):
    """fp32 model (parity; its latents small, so the latent norms' eps matters) and `glm-moe-dsa-bf16` (round trips)."""
    models = fp32_and_bf16_models(tmp_path_factory.mktemp("glm-moe-dsa"), (VARIANT,), 130, 140)
    kv_lora = make_config(VARIANT).kv_lora_rank

    def small_latents(tensors):
        for name, tensor in tensors.items():
            if name.endswith("q_a_proj.weight"):
                tensor.mul_(LATENT_SCALE)
            elif name.endswith("kv_a_proj_with_mqa.weight"):
                tensor[:kv_lora].mul_(LATENT_SCALE)  # the latent, not the key's rotary part

    edit_tensors(models[VARIANT], small_latents)
    return models


def test_settings_interleave_the_indexers_rope_and_keep_the_latent_norms_at_hfs_eps():
    """dsa_indexer_rope_interleaved as GlmMoeDsaIndexer's apply_rotary_pos_emb_interleave; the layer norms at
    rms_norm_eps 1e-5, the q / kv latent norms (LatentRMSNorm) at 1e-6 as HF's AXK1RMSNorm default, whatever eps
    megatron-core passes them. Guard: DeepSeek-V3.2's mapping of the same config is refused for that eps."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    from toolkit.blocks.norms import LatentRMSNorm
    from toolkit.layouts import Layout
    from toolkit.model import transformer_config

    spec = spec_from_config(make_config(VARIANT).to_dict())[1]
    settings = settings_for(spec).transformer
    assert settings["dsa_indexer_rope_interleaved"] and settings["layernorm_epsilon"] == 1e-5
    attention = hf.GlmMoeDsaAttention(make_config(VARIANT), 0)
    assert attention.q_a_layernorm.variance_epsilon == attention.kv_a_layernorm.variance_epsilon == 1e-6
    config = transformer_config(spec, Layout(1, 1), torch.float32, layer_spec="local")
    assert LatentRMSNorm(config, 8, eps=config.layernorm_epsilon).eps == 1e-6
    with pytest.raises(Exception, match=re.escape("q_a_layernorm and kv_a_layernorm keep eps 1e-06")):
        spec_from_config({**make_config(VARIANT).to_dict(), "model_type": "deepseek_v32"})


def test_the_indexer_keeps_hfs_top_k_keys_with_its_rope_interleaved(world_of_one, monkeypatch):  # noqa: F811
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    same, differ = indexer_against_hf(VARIANT, hf.GlmMoeDsaIndexer, hf.GlmMoeDsaRotaryEmbedding, world_of_one,
                                      monkeypatch, {"rope half-split": {"dsa_indexer_rope_interleaved": False}})
    assert same and all(count > 50 for count in differ.values()), differ


def test_shared_indexers_are_refused_in_one_line(tmp_path):
    """IndexShare (GLM-5.1 / 5.2's index_topk_freq: "shared" layers reuse an earlier layer's top-k) is not converted
    yet: refused naming indexer_types, nothing written."""
    src = make_tiny_model(VARIANT, tmp_path / "src", seed=1)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "indexer_types": ["full", "shared", "full", "shared"]}))
    convert_fails(src, tmp_path / "out", re.escape("indexer_types names layers [1, 3] 'shared'"), layer_spec="local")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_glm_moe_dsa, tmp_path, fmt):
    assert_round_trip(tiny_glm_moe_dsa[f"{VARIANT}-bf16"], VARIANT, tmp_path, fmt, "GlmMoeDsaForCausalLM")


def parity_pairs(tiny_glm_moe_dsa, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py: per-rank torch
    files and torch_dist, both to match."""
    return family_parity_pairs(tiny_glm_moe_dsa, (VARIANT, VARIANT), (), None, tmp_path, layer_spec="local")
