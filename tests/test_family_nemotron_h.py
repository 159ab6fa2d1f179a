"""Nemotron-H (nemotron_h): Mamba-2, attention-only and relu^2 MLP-only layers by a pattern, converted for
megatron-core's HybridModel (toolkit/families/nemotron_h.py).

HF is the reference: a tiny NemotronHForCausalLM (transformers' own class and save_pretrained; tests/
test_hybrid_model.py's config and weights: the pattern M-*M-M*- puts every symbol on both stages of PP 2, and
40 tokens run over Mamba chunks of 16) converted at TP2 x PP2 in both formats gives HF's logits and every layer's
output within 1e-4 in fp32 in one `convert verify` launch, where conversions with a TP split swapped for a plain
one (Mamba-2's in_proj and conv1d cut as one block instead of part by part) must fail; both formats export back
to HF's safetensors bit for bit.

Nemotron 3 (its MoE layers, pattern symbol E): the published NVIDIA-Nemotron-3-Nano-30B-A3B config.json, shrunk
(tests/data/published_configs), converts in both formats and exports back bit for bit here; its HF logits are matched
at TP2 x PP2 x EP2 in the published-configs launch (tests/test_published_configs.py, 520 tokens) and, in both formats
with three guards (the expert bias, the shared expert, the routed scaling dropped) that must fail, in the
published-parity launch (tests/test_published_parity.py: parity_pairs)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from tests import published_corpus as corpus
from tests.test_convert_bad_input import edit_config, edit_tensors
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


NANO_30B = "nvidia-nemotron-3-nano-30b-a3b"


def test_nemotron3_reads_its_moe_layers_router_and_shared_expert_from_the_published_file():
    """NemotronHMoE as megatron-core's MoE in E layers: 16 experts (shrunk from 128) top-6 by a sigmoid router with
    the expert bias, renormalised and scaled by 2.5, one shared expert of moe_shared_expert_intermediate_size (48,
    shrunk from 3712; DeepSeek's reading, n_shared_experts x moe_intermediate_size, would give 32); a pattern without
    E (Nano 9B v2) has no experts whatever NemotronHConfig's expert defaults say; the latent MoE refused."""
    from toolkit.megatron_settings import settings_for

    published = corpus.config(NANO_30B)
    spec = spec_from_config(published)[1]
    assert spec.hybrid_pattern == "MEMEM*EMEMEM*EME" and spec.moe_layers is None
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size, spec.moe_shared_ffn_hidden_size) == (16, 6, 32, 48)
    assert (spec.moe_score_function, spec.moe_expert_bias, spec.moe_renormalise, spec.moe_scaling_factor) == (
        "sigmoid", True, True, 2.5)
    settings = settings_for(spec).transformer
    assert (settings["moe_router_enable_expert_bias"], settings["moe_router_dtype"], settings["gated_linear_unit"]) == (
        True, "fp32", False)
    assert not spec_from_config(corpus.config("nvidia-nemotron-nano-9b-v2"))[1].is_moe
    with pytest.raises(ConversionError, match="nemotron_h with moe_latent_size=16 cannot be mapped exactly"):
        spec_from_config({**published, "moe_latent_size": 16})
    with pytest.raises(ConversionError, match="norm_topk_prob=false with num_experts_per_tok=6"):
        spec_from_config({**published, "norm_topk_prob": False})


def test_nemotron3_both_formats_at_tp2_pp2_ep2_export_back_bit_for_bit(tmp_path):
    """The published file's model (bf16, its router weight and expert bias in float32 as transformers 5.24 keeps
    them) through each format and back: every tensor, each expert of each layer, as stored."""
    src = corpus.build_model(NANO_30B, tmp_path / "hf")
    for fmt in FORMATS:
        ckpt = hf_to_megatron(src, tmp_path / fmt, tp=2, pp=2, ep=2, fmt=fmt, progress=False)
        back = megatron_to_hf(ckpt, tmp_path / f"hf-{fmt}", progress=False)
        assert tensor_hashes(back) == tensor_hashes(src), fmt


# Each a copy of the fp32 model with one piece of its MoE dropped, as a converter that forgot it would leave it
NEMOTRON3_GUARDS = ("expert-bias", "shared-expert", "routed-scaling")


def _nemotron3_dropped(src, tmp_path, piece: str):
    copy = shutil.copytree(src, tmp_path / f"n3-no-{piece}")
    if piece == "expert-bias":
        edit_tensors(copy, lambda t: [v.zero_() for k, v in t.items() if k.endswith("gate.e_score_correction_bias")])
    elif piece == "shared-expert":
        edit_tensors(copy, lambda t: [v.zero_() for k, v in t.items() if ".shared_experts.down_proj." in k])
    else:
        edit_config(copy, routed_scaling_factor=1.0)
    return hf_to_megatron(copy, tmp_path / f"m-n3-no-{piece}", tp=2, pp=2, ep=2, progress=False)


def parity_pairs(tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py: the published
    Nano 30B-A3B in fp32 as per-rank torch files and as torch_dist, then NEMOTRON3_GUARDS, which must be far off HF's
    logits; and how many must match."""
    src = corpus.build_model(NANO_30B, tmp_path / "n3-hf", sizes={"torch_dtype": "float32"})
    pairs = [(src, hf_to_megatron(src, tmp_path / f"n3-{fmt}", tp=2, pp=2, ep=2, fmt=fmt, progress=False))
             for fmt in FORMATS]
    return pairs + [(src, _nemotron3_dropped(src, tmp_path, piece)) for piece in NEMOTRON3_GUARDS], len(pairs)


def assert_guards_fail(reports) -> None:
    print({piece: f"{r.max_logit_diff:.2e}" for piece, r in zip(NEMOTRON3_GUARDS, reports)})
    for piece, report in zip(NEMOTRON3_GUARDS, reports, strict=True):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


# NVIDIA-Nemotron-Nano-9B-v2 (tests/data/published_configs, its sizes in index.json): "9B" on its model card, four
# attention layers among 27 Mamba-2 and 25 MLP layers
NANO_9B_V2 = ("nvidia-nemotron-nano-9b-v2", 9, 8_888_227_328)
# NVIDIA-Nemotron-3-Nano-30B-A3B: "30B total" in public descriptions (31.6B by HF's count), 23 Mamba-2, 23 MoE and 6
# attention layers; a token goes through 6 of the 128 routed experts per MoE layer: 3.58B parameters with the
# embeddings and lm_head, 3.23B without the input embeddings (704,643,072 with both, half each), 2.88B without either;
# public descriptions say "3.5B active" (NeMo Megatron-Bridge's, Jetson AI Lab's model pages)
NANO_30B_A3B = (NANO_30B, 32, 31_577_937_344)
NANO_30B_ACTIVE = 3_580_073_408


def _hf_count(cfg: dict) -> tuple[int, int]:
    """(parameters, those a token goes through: num_experts_per_tok of n_routed_experts) of HF's NemotronHForCausalLM
    built on the meta device."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig.from_dict(cfg))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mixer.experts." in n)
    return total, total - experts + experts * model.config.num_experts_per_tok // model.config.n_routed_experts


@pytest.mark.parametrize("name, card_billions, count", [NANO_9B_V2, NANO_30B_A3B])
def test_memory_counts_the_published_parameters_as_hf_builds_them(name, card_billions, count):
    """`toolkit memory`'s count (toolkit.memory.params, from the family table: in_proj, conv1d, A_log, D, dt_bias,
    the gated norm, out_proj per Mamba-2 layer; the router, its expert bias, the routed and shared experts per MoE
    layer) equals HF's NemotronHForCausalLM built on the meta device at the published sizes; TP 1 x PP 1 holds them
    all (131072 already a multiple of 128). Nano 30B-A3B's active count too."""
    from toolkit.memory.params import active_params, stage_buffer_bytes, stage_param_numels, total_params

    cfg = corpus.published_sizes(name)
    spec = spec_from_config(cfg)[1]
    layers = {"M": 27, "*": 4, "-": 25} if name == NANO_9B_V2[0] else {"M": 23, "*": 6, "E": 23}
    assert {symbol: spec.hybrid_pattern.count(symbol) for symbol in layers} == layers
    total, active = _hf_count(cfg)
    assert total_params(spec) == total == count
    assert round(count / 1e9) == card_billions
    assert sum(stage_param_numels(spec, 1, 1, 0)) == count
    if spec.is_moe:
        assert active_params(spec) == active == NANO_30B_ACTIVE
        # the expert bias buffer and megatron-core's token counts beside it: float32 [128] x 2 in each of the 23 E
        # layers, none in the Mamba-2 and attention layers
        assert stage_buffer_bytes(spec, 1, 0) == 23 * 2 * 4 * 128


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
