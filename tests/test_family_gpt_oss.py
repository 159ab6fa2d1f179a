"""gpt-oss (gpt_oss): attention sinks, sliding windows on every other layer, YaRN, q/k/v/o biases, a
router with a bias, experts stored fused (gate and up interleaved) with biases and a clamped SwiGLU,
and the published checkpoints' MXFP4 experts (toolkit/families/gpt_oss.py, toolkit/convert/fused_experts.py).

HF is the reference: megatron-core loading our checkpoints at TP2 x PP2 x EP2 (experts at expert TP 1)
gives HF's logits within 1e-4 in fp32, in the one launch of tests/test_published_parity.py, where
each piece has a guard: the checkpoint converted with it dropped (sinks, clamp, interleave, YaRN,
windows, router bias) fails the parity check. MXFP4 is checked against a dequantization written here
from the format's definition and against transformers' own loader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.conversion_memory import ResidentReads, assert_bounded_by_a_tensor
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.families.gpt_oss import installed_transformers_reads_swiglu
from toolkit.layouts import Layout
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model, quantize_mxfp4

VARIANT = "gpt-oss"
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    """`gpt-oss` fp32 (parity), `gpt-oss-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("gpt-oss"), (VARIANT,), 80, 90)


def test_settings_and_refusals(tmp_path):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    spec = spec_from_config(make_config(VARIANT).to_dict())[1]
    settings = settings_for(spec)
    t = settings.transformer
    assert {k: t[k] for k in ("softmax_type", "add_bias_linear", "activation_func", "activation_func_clamp_value",
                              "glu_linear_offset", "window_size", "window_attn_skip_freq", "moe_router_pre_softmax",
                              "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size")} == {
        "softmax_type": "learnable", "add_bias_linear": True, "activation_func": quick_gelu,
        "activation_func_clamp_value": make_config(VARIANT).swiglu_limit, "glu_linear_offset": 1.0, "window_size": (7, 0),
        "window_attn_skip_freq": [1, 0, 1, 0], "moe_router_pre_softmax": False, "num_moe_experts": 8,
        "moe_router_topk": 3, "moe_ffn_hidden_size": 24}
    assert settings.gpt["position_embedding_type"] == "yarn"
    assert settings.config_attributes == {
        "yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 16, "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0, "yarn_mscale": None, "yarn_mscale_all_dim": None,
        "yarn_correction_range_round_to_int": False}
    assert (spec.expert_tp(2), spec.expert_tp(1)) == (1, 1)
    Layout(2, 2, ep=2).check(spec)  # experts whole on each TP rank: TP 2 is fine
    alpha_refused = "its clamped GLU takes quick_gelu" if installed_transformers_reads_swiglu() else "before 5.19"
    for changes, line in (({"swiglu_alpha": 1.5}, alpha_refused),
                          ({"attention_bias": False}, "add_bias_linear puts a bias on every linear layer"),
                          ({"rope_parameters": {**make_config(VARIANT).rope_parameters, "attention_factor": 1.2}},
                           "an explicit YaRN attention factor")):
        with pytest.raises(ConversionError, match=line):
            spec_from_config(make_config(VARIANT, **changes).to_dict())
    # the recipe at TP 2: EP a multiple of TP, so that each TP rank holds experts of its own (expert TP 1)
    from tests.finetune_harness import recipe_config
    from toolkit.errors import ConfigError
    from toolkit.train.build import check_expert_layout

    for ep, refused in ((1, True), (2, False)):
        cfg = recipe_config(tmp_path, ["parallel.tp=2", f"parallel.ep={ep}", "parallel.sequence_parallel=true"])
        if refused:
            with pytest.raises(ConfigError, match=r"^parallel.tp=2 with parallel.ep=1: gpt_oss's experts have biases, "
                                                  r"which megatron-core runs at expert TP 1 only, .* multiple of 2$"):
                check_expert_layout(cfg, 2, "gpt_oss", spec.expert_tp(2))
        else:
            check_expert_layout(cfg, 2, "gpt_oss", spec.expert_tp(2))
    from toolkit.dsconfig.settings import Setup
    from toolkit.plan import expert_parallel_sizes

    assert expert_parallel_sizes(spec, Setup(gpus=8, tp=2)) == [2, 4]  # `toolkit plan` proposes those only
    src = make_tiny_model(VARIANT, tmp_path / "src", seed=2)
    edit_config(src, quantization_config={"quant_method": "fp8"})
    convert_fails(src, tmp_path / "out", "only MXFP4 expert weights")


def test_yarn_matches_hf_rotary_embedding():
    """megatron-core's YarnRotaryEmbedding with our yarn_* attributes and the attention factor its
    attention applies give HF's cos and sin bit for bit (truncate false: the correction range unrounded)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding, _yarn_get_concentration_factor)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from toolkit.runtime import cpu_compat

    cpu_compat.apply()  # get_emb moves its frequencies to torch.cuda.current_device()
    config = make_config(VARIANT, max_position_embeddings=131072, rope_parameters={
        **make_config(VARIANT).rope_parameters, "original_max_position_embeddings": 4096})
    yarn = spec_from_config(config.to_dict())[1].yarn
    x, positions = torch.zeros(1), torch.arange(64)[None]
    hf_cos, hf_sin = GptOssRotaryEmbedding(config)(x, positions)
    for rounded in (False, True):
        rope = YarnRotaryEmbedding(kv_channels=config.head_dim, rotary_base=150000.0, use_cpu_initialization=True,
                                   scaling_factor=yarn["yarn_rotary_scaling_factor"],
                                   original_max_position_embeddings=yarn["yarn_original_max_position_embeddings"],
                                   beta_fast=yarn["yarn_beta_fast"], beta_slow=yarn["yarn_beta_slow"],
                                   correction_range_round_to_int=rounded or yarn["yarn_correction_range_round_to_int"])
        freqs = rope.get_emb(64)[0][:, 0, 0, : config.head_dim // 2]
        mscale = _yarn_get_concentration_factor(yarn["yarn_rotary_scaling_factor"], yarn["yarn_mscale"],
                                                yarn["yarn_mscale_all_dim"])
        same = torch.equal(torch.cos(freqs) * mscale, hf_cos[0]) and torch.equal(torch.sin(freqs) * mscale, hf_sin[0])
        assert same != rounded, "truncate=false must matter (the rounded range differs from HF's)"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_gpt_oss, tmp_path, fmt):
    """bf16 at TP2 x PP2 x EP2: the fused experts come back fused, bit for bit."""
    from transformers import AutoModelForCausalLM

    src = tiny_gpt_oss[f"{VARIANT}-bf16"]
    original = load_all(src)
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    restored = load_all(megatron_to_hf(out, tmp_path / "h", progress=False))
    assert set(restored) == set(original) and "model.layers.3.mlp.experts.gate_up_proj" in restored
    assert all(torch.equal(restored[k], original[k]) for k in original)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "h")
    assert torch.equal(model.model.layers[2].self_attn.sinks, original["model.layers.2.self_attn.sinks"].float())


# ---- MXFP4 ----

def e2m1(code: int) -> float:
    """An FP4 (E2M1) code as OCP Microscaling defines it: sign, 2 exponent bits (bias 1), 1 mantissa bit;
    exponent 0 is subnormal (0 or 0.5)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def dequantized_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, out, G, 16] codes (byte b holds elements 2b in its low nibble, 2b + 1 in its high one) and
    [E, out, G] E8M0 scales -> HF's weight [E, in, out] (applied as x @ W), in bf16."""
    lut = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    low, high = lut[(blocks & 15).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [E, out, G, 32]
    values = values * 2.0 ** (scales.double() - 127)[..., None]
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)


def quantize_experts(src, dst) -> dict[str, torch.Tensor]:
    """`dst`: `src` with its experts' weights replaced by random MXFP4 blocks and scales (as published:
    `<name>_blocks` [E, out, in / 32, 16] uint8, `<name>_scales` [E, out, in / 32] uint8, quantization_config
    mxfp4); returns the dequantized weights as HF uses them, by dequantized_reference."""
    shutil.copytree(src, dst)
    packed = quantize_mxfp4(dst)
    edit_config(dst, quantization_config=MXFP4_CONFIG)
    return {name: dequantized_reference(blocks, scales) for name, (blocks, scales) in packed.items()}


def test_mxfp4_dequantization_matches_the_format_and_transformers():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    from toolkit.convert.fused_experts import dequantize_mxfp4

    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 10, 2), generator=generator, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales).transpose(1, 2)  # as the converter reads it: [E, out, in]
    assert torch.equal(ours, dequantized_reference(blocks, scales))
    assert torch.equal(ours, _convert_moe_packed_tensors(blocks, scales))


def test_mxfp4_checkpoint_converts_with_a_line_and_exports_as_transformers_dequantizes_it(tmp_path, capfd,
                                                                                          monkeypatch):
    """The published layout (MXFP4 experts; in-dims multiples of 32) at TP2 x PP2 x EP2: one line says the
    experts are dequantized; the export is bf16 without quantization_config, its experts equal the
    reference dequantization, every other tensor the source's, and it equals what transformers itself
    loads from the MXFP4 checkpoint (its own dequantization), logits included. Memory stays bounded by a
    tensor: one expert at a time is cut from a layer's fused blocks and dequantized, never the layer's
    fused tensor (tests/conversion_memory.py)."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(VARIANT, tmp_path / "bf16", dtype="bfloat16", seed=4, intermediate_size=32)
    expected = quantize_experts(src, tmp_path / "mxfp4")
    resident = ResidentReads.following(monkeypatch)
    out = hf_to_megatron(tmp_path / "mxfp4", tmp_path / "m", tp=2, pp=2, ep=2, progress=False)
    assert_bounded_by_a_tensor(resident)
    monkeypatch.undo()
    assert "MXFP4 weights (8 tensors, e.g. 'model.layers.0.mlp.experts.down_proj_blocks' with its _scales) are " \
           "dequantized to bfloat16 on import" in capfd.readouterr().err
    back = megatron_to_hf(out, tmp_path / "h", progress=False)
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    exported, original = load_all(back), load_all(src)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], expected[k] if k in expected else original[k]) for k in original)
    tokens = torch.randint(0, 251, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4")
        ours = AutoModelForCausalLM.from_pretrained(back, dtype=torch.bfloat16)
        assert all(torch.equal(v, ours.state_dict()[k]) for k, v in theirs.state_dict().items())
        assert torch.equal(theirs(tokens).logits, ours(tokens).logits)


def test_fused_experts_damaged_are_refused(tiny_gpt_oss, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_gpt_oss[f"{VARIANT}-bf16"], src)
    edit_tensors(src, lambda t: t.pop("model.layers.1.mlp.experts.down_proj"))
    convert_fails(src, tmp_path / "out", "layer 1's fused experts are incomplete or mixed: missing "
                                         "'model.layers.1.mlp.experts.down_proj'")


def test_swiglu_limit_converts_as_the_installed_transformers_computes_it(tiny_gpt_oss, tmp_path):
    """transformers 5.19 reads swiglu_limit from the config; 5.17 and 5.18 compute with 7.0 whatever it says,
    so a checkpoint with another limit is another model there: refused in one line naming the fix."""
    src = tmp_path / "src"
    shutil.copytree(tiny_gpt_oss[f"{VARIANT}-bf16"], src)
    edit_config(src, swiglu_limit=2.5)
    if installed_transformers_reads_swiglu():
        assert spec_from_config(json.loads((src / "config.json").read_text()))[1].glu_clamp == 2.5
    else:
        convert_fails(src, tmp_path / "out", r"^config\.json has swiglu_limit=2\.5, which transformers \S+ ignores "
                                             r"\(before 5\.19 its GptOssExperts computes with swiglu_limit=7\.0\)[^\n]*"
                                             r"install transformers>=5\.19 to convert it$")


# ---- parity (in the launch of tests/test_published_parity.py) ----

def _interleave_dropped(tensors):
    """gate_up laid out as [gate | up] halves: what a converter that misses the interleave reads as HF's."""
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias"))]:
        t = tensors[name]
        tensors[name] = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


GUARDS = {
    "sinks": lambda src: edit_tensors(src, lambda t: [v.fill_(-1e9) for k, v in t.items() if k.endswith("sinks")]),
    # transformers before 5.19 computes with 7.0 whatever the config says (test_swiglu_limit_...): no clamp to drop
    **({"clamp": lambda src: edit_config(src, swiglu_limit=1e9)} if installed_transformers_reads_swiglu() else {}),
    "interleave": lambda src: edit_tensors(src, _interleave_dropped),
    "yarn": lambda src: edit_config(src, rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
    "windows": lambda src: edit_config(src, layer_types=["full_attention"] * 4),
    "router-bias": lambda src: edit_tensors(src, lambda t: [v.zero_() for k, v in t.items() if k.endswith("router.bias")]),
}


def parity_pairs(tiny_gpt_oss, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch: the model as per-rank torch files and as
    torch_dist, then the model converted with each piece dropped (GUARDS), which must be far off HF's
    logits; and how many must match."""
    src = tiny_gpt_oss[VARIANT]
    pairs = [(src, hf_to_megatron(src, tmp_path / f"gpt-oss-{fmt}", tp=2, pp=2, ep=2, fmt=fmt, progress=False))
             for fmt in ("torch", "torch_dist")]
    for piece, drop in GUARDS.items():
        copy = tmp_path / f"gpt-oss-no-{piece}"
        shutil.copytree(src, copy)
        drop(copy)
        pairs.append((src, hf_to_megatron(copy, tmp_path / f"gpt-oss-m-no-{piece}", tp=2, pp=2, ep=2, progress=False)))
    return pairs, 2


def assert_guards_fail(reports) -> None:
    print({piece: f"{r.max_logit_diff:.2e}" for piece, r in zip(GUARDS, reports)})
    for piece, report in zip(GUARDS, reports):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


# The published config.json of openai/gpt-oss-20b (https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json;
# GitHub's jihengzhang/jihz-gpt-oss-20b gpt-oss-20b/config.json @7ec89800 holds the same keys and values less
# quantization_config); gpt-oss-120b differs in the layers and experts only.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": MXFP4_CONFIG, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
GPT_OSS_120B = {**GPT_OSS_20B, "layer_types": ["sliding_attention", "full_attention"] * 18, "num_hidden_layers": 36,
                "num_local_experts": 128}


# The model card's "21B parameters with 3.6B active" / "117B with 5.1B active": active without the input
# embedding (a lookup), the output layer counted
@pytest.mark.parametrize("published, billions, active_billions", [(GPT_OSS_20B, 20.91, 3.6), (GPT_OSS_120B, 116.83, 5.1)])
def test_published_sizes_read_and_count_as_hf_builds_them(published, billions, active_billions):
    """The published configs read as the tiny one (YaRN with truncate false, windows of 128 on every other
    layer, the SwiGLU limit 7), and `toolkit memory` counts the parameters HF's model has (built on the
    meta device): sinks and every bias included; active: 4 of the experts (HF's fused experts scaled)."""
    from transformers import GptOssConfig

    from tests.test_memory_moe_families import hf_counts
    from toolkit.memory.params import active_params, stage_param_numels

    spec = spec_from_config(published)[1]
    assert (spec.yarn["yarn_correction_range_round_to_int"], spec.window_size, spec.window_layers[:4], spec.glu_clamp,
            spec.num_experts, spec.moe_topk) == (False, 128, "1010", 7.0, published["num_local_experts"], 4)
    hf, hf_active = hf_counts(GptOssConfig(**published))
    assert sum(stage_param_numels(spec, 1, 1, 0)) == hf and round(hf / 1e9, 2) == billions
    assert active_params(spec) == hf_active
    assert round((hf_active - spec.vocab_size * spec.hidden_size) / 1e9, 1) == active_billions
    # at TP 2 the experts stay whole on each rank (expert TP 1): only the rest halves
    experts = sum(stage_param_numels(spec, 1, 1, 0, part="experts"))
    assert sum(stage_param_numels(spec, 2, 1, 0, part="experts")) == experts


# The load-balancing loss's coefficient in the fine-tuning tests: raised from HF's default (0.001) so that
# a wrong aux gradient shows; HF adds the loss only with output_router_logits, which the reference sets.
AUX_LOSS_COEF = 0.1
# The gradient-norm bar of the TP2 launch, tighter than the issue's 1e-4: measured 7.3e-7; with TP rank 1's
# attention sinks left out of DeepSpeed's norm (megatron-core leaves them untagged, toolkit/model.py
# tag_sinks_split_over_tp) it was 2.6e-5, under 1e-4 because the tiny model's sinks have small gradients.
TP_GRAD_NORM_TOLERANCE = 5e-6
# Per exported tensor, its change over the run against the reference's (tests/moe_reference.py
# weight_change_errors): the bar of tests/test_moe_finetune.py's EXPERT_TOLERANCE.
WEIGHT_CHANGE_TOLERANCE = 1e-4


@pytest.mark.multiprocess
def test_dp2_ep2_fine_tune_with_hfs_own_aux_loss_matches_hf(tmp_path):
    """The recipe at DP2 x EP2 with moe.aux_loss=hf against HF's own training objective: the causal-LM
    loss plus router_aux_loss_coef (0.1) times the `aux_loss` GptOssForCausalLM returns with
    output_router_logits=True (load_balancing_loss_func over all layers pooled, padding left out by the
    attention mask), routers in fp64 on both sides; losses, gradient norms and every step's routing over
    10 steps. (HF's pooled form needs every layer on one stage: TP2 x PP2 below takes megatron-core's.)"""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS
    from tests.moe_reference import family_finetune_parity, moe_step_loss, pad_token_id, route_in_fp64

    run = family_finetune_parity(tmp_path, VARIANT, 2, {"ep": 2}, lambda hf: moe_step_loss(pad_token_id(hf), "hf"),
                                 moe={"router_dtype": "fp64", "aux_loss": "hf"},
                                 prepare=route_in_fp64, router_aux_loss_coef=AUX_LOSS_COEF)
    print(f"gpt-oss DP2xEP2 (HF's aux loss): max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [m["tokens_per_expert"] for m in run.metrics] == run.step_loss.routing


@pytest.mark.multiprocess
def test_tp2_pp2_dp2_ep2_fine_tune_with_aux_loss_matches_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 x EP2 with sequence parallelism on a tiny fp32 gpt-oss (sinks split
    over TP with the heads, alternating windows, YaRN, biases everywhere, the clamped SwiGLU; the experts
    whole on each TP rank at expert TP 1, so the EP pair is a TP pair and the experts' DP group is not
    attention's), with the routers' load-balancing loss (router_aux_loss_coef 0.1, megatron-core's
    per-layer form, as tests/moe_reference.py writes it from HF's router logits of output_router_logits)
    and the routers in fp64 on both sides: HF + torch AdamW's losses and gradient norms over 10 steps, and
    every step's tokens per expert as HF's routers chose them. Weight decay skips the experts' biases on
    both sides: HF stacks them into 2-D tensors, so the reference excludes biases by name, as
    transformers' Trainer does (with HF's 2-D biases decayed the reference was 1.3e-3 off)."""
    from tests.finetune_harness import LOSS_TOLERANCE_FP32, STEPS
    from tests.moe_reference import (family_finetune_parity, moe_step_loss, pad_token_id, route_in_fp64,
                                     weight_change_errors)

    final = {}  # the reference's weights after its last step

    def keep(step, model):
        if step == STEPS:
            final.update({name: tensor.detach().clone() for name, tensor in model.state_dict().items()})

    run = family_finetune_parity(tmp_path, VARIANT, 8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: moe_step_loss(pad_token_id(hf)), moe={"router_dtype": "fp64"},
                                 prepare=route_in_fp64, on_step=keep, export_hf=True, router_aux_loss_coef=AUX_LOSS_COEF)
    print(f"gpt-oss TP2xPP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}; closest "
          f"top-k margin {min(run.step_loss.margins):.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < TP_GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [m["tokens_per_expert"] for m in run.metrics] == run.step_loss.routing
    # the HF export merges every (TP, PP, EP) rank's weights: each tensor (the stacked experts and their
    # biases, the sinks, the router) trained as the reference's
    errors = weight_change_errors(load_all(run.hf), load_all(tmp_path / "run" / "hf"), final)
    worst = max(errors, key=errors.get)
    print(f"export: {len(errors)} tensors, worst {worst} {errors[worst]:.1e}")
    assert len(errors) == len(final) and errors[worst] < WEIGHT_CHANGE_TOLERANCE, (worst, errors[worst])
