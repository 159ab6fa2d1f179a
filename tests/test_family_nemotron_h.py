"""Nemotron-H (nemotron_h): Mamba-2, attention-only and relu^2 MLP-only layers by a pattern, converted for
megatron-core's HybridModel (toolkit/families/nemotron_h.py).

HF is the reference: a tiny NemotronHForCausalLM (transformers' own class and save_pretrained; tests/
test_hybrid_model.py's config and weights: the pattern M-*M-M*- puts every symbol on both stages of PP 2, and
40 tokens run over Mamba chunks of 16) converted at TP2 x PP2 in both formats gives HF's logits and every layer's
output within 1e-4 in fp32 in one `convert verify` launch, where conversions with a TP split swapped for a plain
one (Mamba-2's in_proj and conv1d cut as one block instead of part by part) must fail; both formats export back
to HF's safetensors bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from tests.test_hybrid_model import SEQ, _hf_model
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.layouts import Layout
from toolkit.splits import Split

FORMATS = ("torch", "torch_dist")
# Splits swapped for a plain block split (Split.COLUMN: rank r the r-th block of rows), each converted and verified
GUARDS = {"in-proj-as-one-block": Split.MAMBA_IN_PROJ, "conv-as-one-block": Split.MAMBA_CONV}


@pytest.fixture(scope="module")
def tiny_nemotron_h(tmp_path_factory):
    config, model = _hf_model()
    out = tmp_path_factory.mktemp("nemotron-h") / "hf"
    model.save_pretrained(out)
    return out


def test_spec_settings_and_refusals():
    from toolkit.megatron_settings import settings_for

    config = _hf_model()[0]  # transformers' NemotronHConfig
    spec = spec_from_config(config.to_dict())[1]
    assert (spec.family, spec.num_layers, spec.hybrid_pattern, spec.rope_theta, spec.activation) == (
        "nemotron_h", 8, "M-*M-M*-", None, "relu2")
    assert spec.mamba == {"heads": 4, "head_dim": 8, "groups": 2, "state": 8, "conv_kernel": 4, "chunk_size": 16}
    settings = settings_for(spec)
    assert settings.transformer["gated_linear_unit"] is False and settings.transformer["is_hybrid_model"] is True
    assert settings.gpt["position_embedding_type"] == "none"
    base = config.to_dict()
    for changes, line in (
            ({"layers_block_type": ["linear_attention", "moe"] * 4}, r"layers_block_type\[1\]='moe'.*pattern symbol E"),
            ({"mlp_bias": True}, "nemotron_h with mlp_bias=True"),
            ({"use_bias": True}, "nemotron_h with use_bias=True"),
            ({"use_conv_bias": False}, "nemotron_h with use_conv_bias=False"),
            ({"tie_word_embeddings": True}, "nemotron_h with tie_word_embeddings=True"),
            ({"layer_norm_epsilon": 1e-6}, "nemotron_h with layer_norm_epsilon=1e-06"),
            ({"mamba_hidden_act": "relu"}, "nemotron_h with mamba_hidden_act='relu'"),
            ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' is not supported for nemotron_h"),
            ({"mamba_num_heads": 6, "n_groups": 4}, "mamba_num_heads=6 not a multiple of n_groups=4")):
        with pytest.raises(ConversionError, match=line):
            spec_from_config({**base, **changes})
    file = {k: v for k, v in base.items() if k != "layers_block_type"}
    with pytest.raises(ConversionError, match="refused by transformers' NemotronHConfig"):  # an unknown symbol
        spec_from_config({**file, "hybrid_override_pattern": "M-X*"})
    assert spec_from_config({**file, "hybrid_override_pattern": "M*-M"})[1].hybrid_pattern == "M*-M"  # as published
    with pytest.raises(ConversionError, match="n_groups 2 is not divisible by --tp 4"):
        Layout(4, 1).check(spec)


def _as_one_block(monkeypatch, split):
    """The family table with `split`'s rows cut as one block per TP rank, for the conversions that follow."""
    import toolkit.families as families
    from toolkit.families.nemotron_h import NEMOTRON_H

    wrong = dataclasses.replace(NEMOTRON_H, rows=tuple(dataclasses.replace(r, split=Split.COLUMN) if r.split is split
                                                       else r for r in NEMOTRON_H.rows))
    monkeypatch.setattr(families, "FAMILIES", tuple(wrong if f is NEMOTRON_H else f for f in families.FAMILIES))


@pytest.mark.multiprocess
def test_tp2_pp2_both_formats_match_hf_round_trip_bit_exactly_and_wrong_splits_fail(tiny_nemotron_h, tmp_path,
                                                                                     monkeypatch):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import verify_many

    src = tiny_nemotron_h
    converted = {fmt: hf_to_megatron(src, tmp_path / fmt, tp=2, pp=2, fmt=fmt, progress=False) for fmt in FORMATS}
    for fmt, ckpt in converted.items():
        back = megatron_to_hf(ckpt, tmp_path / f"hf-{fmt}", progress=False)
        assert tensor_hashes(back) == tensor_hashes(src), fmt
    assert AutoModelForCausalLM.from_pretrained(back).model.layers[2].block_type == "full_attention"
    wrong = {}
    for piece, split in GUARDS.items():
        with monkeypatch.context() as patch:
            _as_one_block(patch, split)
            wrong[piece] = hf_to_megatron(src, tmp_path / piece, tp=2, pp=2, progress=False)
    reports = verify_many([(src, converted[fmt]) for fmt in FORMATS] + [(src, ckpt) for ckpt in wrong.values()],
                          seq_len=SEQ)
    for report in reports[:len(FORMATS)]:
        print("\n".join(report.lines()))
        assert report.ok and report.max_logit_diff < FP32_TOLERANCE and len(report.layer_diffs) == 8, report.checkpoint
        assert max(report.layer_diffs) < FP32_TOLERANCE and report.top1_agreement == 1.0, report.checkpoint
    print({piece: f"{r.max_logit_diff:.2e}" for piece, r in zip(GUARDS, reports[len(FORMATS):])})
    for piece, report in zip(GUARDS, reports[len(FORMATS):], strict=True):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


@pytest.fixture(scope="module")
def nemotron_h_parity(tmp_path_factory):
    from tests.finetune_harness import parity_setup

    return parity_setup(tmp_path_factory.mktemp("nemotron-h-finetune"), {"nemotron-h": "nemotron-h"})


@pytest.mark.multiprocess
def test_guard_the_mamba_norm_summed_over_tp_fails_the_fine_tune_parity(nemotron_h_parity, tmp_path):
    """Mamba-2's A_log, D, dt_bias and gated norm are split over TP with the heads (megatron-core tags them
    tensor_model_parallel), so none is summed over TP, unlike a gated delta net's output norm (one weight over every
    rank's heads, toolkit/train/parallel.py). Guard of tests/test_finetune_parity.py's nemotron-h case (losses 8.2e-7,
    grad norms 4.6e-7 relative off HF at TP2 x PP2): the gated norm's gradient summed over TP as that one's
    (tests/recipe_with_defect.py tp-sum), TP 2 for 3 steps, is 1.7e-4 off on the losses and 2.9e-4 on the norms."""
    from tests.finetune_harness import LOSS_TOLERANCE_FP32, REPO, run_against_reference

    _, loss, norm = run_against_reference(nemotron_h_parity, tmp_path, 2, "nemotron-h", steps=3,
                                          parallel={"tp": 2, "pp": 1, "zero_stage": 1},
                                          script=REPO / "tests" / "recipe_with_defect.py",
                                          env={"DEFECT": "tp-sum:.mixer.norm."})
    print(f"Mamba's gated norm summed over TP: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss > 10 * LOSS_TOLERANCE_FP32, loss


# NVIDIA-Nemotron-Nano-9B-v2 (tests/data/published_configs, its sizes in index.json): "9B" on its model card, four
# attention layers among 27 Mamba-2 and 25 MLP layers
NANO_9B_V2 = ("nvidia-nemotron-nano-9b-v2", 9, 8_888_227_328)


def test_memory_counts_nano_9b_v2s_published_parameters_as_hf_builds_them():
    """`toolkit memory`'s count (toolkit.memory.params, from the family table: in_proj, conv1d, A_log, D, dt_bias,
    the gated norm, out_proj per Mamba-2 layer) equals HF's NemotronHForCausalLM built on the meta device at the
    published sizes, the card's 9B; TP 1 x PP 1 holds them all (131072 already a multiple of 128)."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import stage_param_numels, total_params

    name, card_billions, count = NANO_9B_V2
    cfg = corpus.published_sizes(name)
    spec = spec_from_config(cfg)[1]
    assert (spec.num_layers, spec.hybrid_pattern.count("M"), spec.hybrid_pattern.count("*")) == (56, 27, 4)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig.from_dict(cfg))
    assert total_params(spec) == sum(p.numel() for p in model.parameters()) == count
    assert round(count / 1e9) == card_billions
    assert sum(stage_param_numels(spec, 1, 1, 0)) == count


def test_packing_is_refused_in_one_line_before_any_process_group(nemotron_h_parity, tmp_path):
    """MambaLayer takes no document mask: packed documents would share the scan's state, so data.pack is refused."""
    from tests.finetune_harness import recipe
    from toolkit.errors import ConfigError
    from toolkit.train.build import read_checkpoint_meta
    from toolkit.train.config import load_config

    _, data, models, _ = nemotron_h_parity
    cfg = load_config(str(recipe(tmp_path, models["nemotron-h"][1], data, data__pack=True)), [])
    with pytest.raises(ConfigError, match=r"data.pack=true with nemotron_h's Mamba-2 layers") as refused:
        read_checkpoint_meta(cfg)
    assert "\n" not in str(refused.value)
