"""GLM-5 (glm_moe_dsa): DeepSeek-V3.2's mapping (tests/test_family_deepseek_v32.py) with its indexer's RoPE interleaved
and its latent norms at HF's 1e-6 under rms_norm_eps 1e-5 (toolkit/families/glm_moe_dsa.py).

HF is the reference: the indexer keeps GlmMoeDsaIndexer's top-k keys for every query (guard: its RoPE half-split as
DeepSeek-V3.2's keeps others); the model at TP2 x PP2 x EP2 in both formats gives HF's logits within 1e-4 in fp32 (in
the one launch of tests/test_published_parity.py, index_topk 8 of 32 tokens; its indexer guards are DeepSeek-V3.2's,
the same modules), on a model whose latents are small enough that the latent norms at 1e-5 would be 0.82 off; and
with IndexShare (indexer_types "shared": megatron-core's dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import convert_fails, edit_tensors
from tests.test_family_deepseek_v32 import assert_round_trip, indexer_against_hf, world_of_one  # noqa: F401  (fixture)
from tests.test_family_glm4_moe import family_parity_pairs
from toolkit.convert import hf_to_megatron
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "glm-moe-dsa"
SHARED = "glm-moe-dsa-shared"  # IndexShare: layers 1 and 3 reuse the top-k of layers 0 and 2
LOCAL = {"layer_spec": "local", "progress": False}


# The q and kv latents scaled by this before their norms (which undo it but for eps): at 1e-5 in those norms instead of
# HF's 1e-6 the fp32 model's logits are then 0.82 off HF's (9.5e-7 as converted), not the 8e-5 of the unscaled model
LATENT_SCALE = 0.02


@pytest.fixture(scope="module")
def tiny_glm_moe_dsa(tmp_path_factory):
    """fp32 model (parity; its latents small, so the latent norms' eps matters) and `glm-moe-dsa-bf16` (round trips)."""
    models = fp32_and_bf16_models(tmp_path_factory.mktemp("glm-moe-dsa"), (VARIANT, SHARED), 130, 140)
    kv_lora = make_config(VARIANT).kv_lora_rank

    def small_latents(tensors):
        for name, tensor in tensors.items():
            if name.endswith("q_a_proj.weight"):
                tensor.mul_(LATENT_SCALE)
            elif name.endswith("kv_a_proj_with_mqa.weight"):
                tensor[:kv_lora].mul_(LATENT_SCALE)  # the latent, not the key's rotary part

    for variant in (VARIANT, SHARED):
        edit_tensors(models[variant], small_latents)
    return models


def test_settings_interleave_the_indexers_rope_and_keep_the_latent_norms_at_hfs_eps():
    """dsa_indexer_rope_interleaved as GlmMoeDsaIndexer's apply_rotary_pos_emb_interleave; the layer norms at
    rms_norm_eps 1e-5, the q / kv latent norms (LatentRMSNorm) at 1e-6 as HF's AXK1RMSNorm default, whatever eps
    megatron-core passes them (every MLA family's, toolkit/blocks/attention_mla.py with_mla_core_attention)."""
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


def test_the_indexer_keeps_hfs_top_k_keys_with_its_rope_interleaved(world_of_one, monkeypatch):  # noqa: F811
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    same, differ = indexer_against_hf(VARIANT, hf.GlmMoeDsaIndexer, hf.GlmMoeDsaRotaryEmbedding, world_of_one,
                                      monkeypatch, {"rope half-split": {"dsa_indexer_rope_interleaved": False}})
    assert same and all(count > 50 for count in differ.values()), differ


def test_index_share_is_megatron_cores_schedule_and_another_pattern_is_refused(tmp_path):
    """indexer_types as megatron-core's dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset: the tiny model's
    [full, shared, full, shared] is (2, 1), GLM-5.2's 78 layers of index_topk_freq 4 after 3 (as GlmMoeDsaConfig
    derives them) are (4, 3) with the indexer's rows on its 21 full layers only; a pattern no schedule gives is refused
    in one line, nothing written."""
    from transformers import GlmMoeDsaConfig

    spec = spec_from_config(make_config(SHARED).to_dict())[1]
    settings = settings_for(spec).transformer
    assert (settings["dsa_indexer_topk_freq"], settings["dsa_indexer_skip_topk_offset"], spec.linear_layers) == (2, 1, "0303")
    glm52 = GlmMoeDsaConfig(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3).to_dict()
    spec52 = spec_from_config(glm52)[1]
    assert (spec52.dsa["topk_freq"], spec52.dsa["skip_topk_offset"], spec52.linear_layers.count("0")) == (4, 3, 21)
    src = make_tiny_model(VARIANT, tmp_path / "src", seed=1)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "indexer_types": ["full", "shared", "full", "full"]}))
    convert_fails(src, tmp_path / "out", re.escape("is not megatron-core's schedule"), layer_spec="local")


@pytest.mark.parametrize("variant, fmt", [(VARIANT, "torch"), (VARIANT, "torch_dist"), (SHARED, "torch")])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_glm_moe_dsa, tmp_path, variant, fmt):
    """With IndexShare too: the indexer's tensors on the full layers only, as megatron-core's ranks hold them."""
    assert_round_trip(tiny_glm_moe_dsa[f"{variant}-bf16"], variant, tmp_path, fmt, "GlmMoeDsaForCausalLM")


def parity_pairs(tiny_glm_moe_dsa, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py: per-rank torch
    files and torch_dist, and the IndexShare model as torch_dist, all to match."""
    pairs, matching = family_parity_pairs(tiny_glm_moe_dsa, (VARIANT, VARIANT), (), None, tmp_path, layer_spec="local")
    shared = tiny_glm_moe_dsa[SHARED]
    return pairs + [(shared, hf_to_megatron(shared, tmp_path / f"{SHARED}-torch_dist", tp=2, pp=2, ep=2,
                                            fmt="torch_dist", **LOCAL))], matching + 1
