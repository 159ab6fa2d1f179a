"""GLM-4.5 (glm4_moe): DeepSeek-V3's sigmoid router with expert bias, group-limited top-k and routed
scaling, ungated shared experts, a dense first layer, partial RoPE, per-head q/k norms and q/k/v
biases where the config has them (toolkit/families/glm4_moe.py, sigmoid_router.py).

HF is the reference: megatron-core's router function gives HF's routing weights token for token
(in process), and megatron-core loading our checkpoints at TP2 x PP2 x EP2 gives HF's logits within
1e-4 in fp32 (in the one launch of tests/test_published_parity.py). Each piece has a guard in that
launch: the checkpoint converted with it dropped (expert bias, group limit, scaling, shared experts)
fails the parity check."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.moe_reference import routed_per_document
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.families import family_named, spec_from_config
from toolkit.families.float32 import installed_float32
from toolkit.megatron_settings import settings_for
from toolkit.memory.params import stage_param_numels
from toolkit.tinymodels import make_config, make_tiny_model

VARIANTS = ("glm4-moe", "glm4-moe-air")


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    """variant -> fp32 model (parity), `<variant>-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("glm4-moe"), VARIANTS, 60, 70)


def hf_router(config, weight, bias, x):
    """HF's routing weights per token and expert: the family's own TopkRouter class (Glm4MoeTopkRouter,
    DeepseekV3TopkRouter)."""
    import importlib

    name = type(config).__name__.removesuffix("Config")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    router = getattr(module, f"{name}TopkRouter")(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
        _, weights, indices = router(x)
    return torch.zeros(x.shape[0], config.n_routed_experts).scatter(1, indices, weights)


def mcore_router(spec, weight, bias, x):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    settings = settings_for(spec).transformer
    probs, _ = topk_routing_with_score_function(
        x.float() @ weight.T, settings["moe_router_topk"], num_groups=settings["moe_router_num_groups"],
        group_topk=settings["moe_router_group_topk"], scaling_factor=settings["moe_router_topk_scaling_factor"],
        score_function=settings["moe_router_score_function"],
        expert_bias=bias if settings["moe_router_enable_expert_bias"] else None)
    return probs


@pytest.mark.parametrize("variant, changes", [
    ("glm4-moe", {}), ("glm4-moe", {"n_group": 1, "topk_group": 1}),
    ("glm4-moe", {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}), ("glm4-moe", {"routed_scaling_factor": 1.0}),
    ("glm4-moe", {"num_experts_per_tok": 1, "norm_topk_prob": False, "n_group": 1, "topk_group": 1}),
    ("deepseek-v3", {})])
def test_megatron_cores_sigmoid_router_gives_hf_routing_weights(variant, changes):
    """DeepSeek-V3's router as HF computes it (Glm4MoeTopkRouter, DeepseekV3TopkRouter) and megatron-core's
    router function with our settings: the same experts and weights for 512 tokens, with a bias that changes
    the selection."""
    config = make_config(variant, **changes)
    spec = spec_from_config(config.to_dict())[1]
    torch.manual_seed(0)
    x, weight = torch.randn(512, config.hidden_size), torch.randn(config.n_routed_experts, config.hidden_size) * 0.15
    bias = torch.randn(config.n_routed_experts) * 0.2
    hf = hf_router(config, weight, bias, x)
    assert torch.allclose(mcore_router(spec, weight, bias, x), hf, rtol=0, atol=1e-6)
    unbiased = hf_router(config, weight, torch.zeros_like(bias), x)
    assert ((unbiased > 0) != (hf > 0)).any(), "the bias must change which experts are chosen"


def test_settings_and_refusals_of_what_megatron_core_routes_otherwise(tmp_path):
    settings = settings_for(spec_from_config(make_config("glm4-moe").to_dict())[1]).transformer
    assert {k: settings[k] for k in ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                                     "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_dtype",
                                     "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
                                     "qk_layernorm", "add_qkv_bias")} == {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32",
        "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": False, "moe_layer_freq": [0, 1, 1, 1],
        "qk_layernorm": True, "add_qkv_bias": True}
    air = settings_for(spec_from_config(make_config("glm4-moe-air").to_dict())[1]).transformer
    assert (air["moe_router_num_groups"], air["add_qkv_bias"], "qk_layernorm" in air) == (None, False, False)
    src = make_tiny_model("glm4-moe", tmp_path / "src", seed=1)
    for changes, line in (({"norm_topk_prob": False}, "renormalises the top-k weights exactly where k > 1"),
                          ({"n_group": 2, "topk_group": 1}, "ranks groups by their top-4 scores, HF by their top-2"),
                          ({"first_k_dense_replace": 4}, "first_k_dense_replace=4")):
        edit_config(src, **changes)
        convert_fails(src, tmp_path / "out", line)
        edit_config(src, **make_config("glm4-moe").to_dict())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_glm, tmp_path, fmt):
    """Both variants (with and without q/k norms and biases), bf16 with the expert bias in float32 as
    published (HF's _keep_in_fp32_modules_strict), at TP2 x PP2 x EP2: every tensor back in its dtype."""
    from transformers import AutoModelForCausalLM

    for variant in VARIANTS:
        src = tiny_glm[f"{variant}-bf16"]
        original = load_all(src)
        out = hf_to_megatron(src, tmp_path / f"m-{variant}", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
        back = megatron_to_hf(out, tmp_path / f"h-{variant}", progress=False)
        restored = load_all(back)
        assert set(restored) == set(original), variant
        assert all(torch.equal(restored[k], original[k]) and restored[k].dtype == original[k].dtype
                   for k in original), variant
        model = AutoModelForCausalLM.from_pretrained(back)
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert torch.equal(bias, original["model.layers.1.mlp.gate.e_score_correction_bias"].float()) and bias.any()


def _dropped(tiny_glm, tmp_path, piece: str):
    """A copy of the fp32 GLM model with one piece dropped, converted at TP2 x PP2 x EP2."""
    src = tmp_path / f"no-{piece}"
    shutil.copytree(tiny_glm["glm4-moe"], src)
    if piece == "expert-bias":
        edit_tensors(src, lambda t: [v.zero_() for k, v in t.items() if k.endswith("e_score_correction_bias")])
    elif piece == "shared-experts":
        edit_tensors(src, lambda t: [v.zero_() for k, v in t.items() if ".shared_experts.down_proj." in k])
    elif piece == "group-limit":
        edit_config(src, n_group=1, topk_group=1)
    else:
        edit_config(src, routed_scaling_factor=1.0)
    return hf_to_megatron(src, tmp_path / f"m-no-{piece}", tp=2, pp=2, ep=2, progress=False)


GUARDS = ("expert-bias", "group-limit", "scaling", "shared-experts")


def parity_pairs(tiny_glm, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py
    (process start-up dominates, so one launch for all): the full model as per-rank torch files, the
    Air-like one as torch_dist, then one guard per piece, which must be far off HF's logits; and
    how many of them must match."""
    return family_parity_pairs(tiny_glm, VARIANTS, GUARDS, _dropped, tmp_path)


def family_parity_pairs(models: dict, variants, guards, dropped, tmp_path, **convert) -> tuple[list, int]:
    """The first variant as per-rank torch files, the second as torch_dist, then `dropped(models, tmp_path,
    piece)` for each guard, all at TP2 x PP2 x EP2; and how many of them must match."""
    pairs = [(models[v], hf_to_megatron(models[v], tmp_path / f"{v}-{fmt}", tp=2, pp=2, ep=2, fmt=fmt, progress=False,
                                        **convert))
             for v, fmt in zip(variants, ("torch", "torch_dist"))]
    return pairs + [(models[variants[0]], dropped(models, tmp_path, piece)) for piece in guards], len(pairs)


def assert_guards_fail(reports, guards=GUARDS) -> None:
    print({r.checkpoint.rsplit("/", 1)[-1]: f"{r.max_logit_diff:.2e}" for r in reports})
    for piece, report in zip(guards, reports):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


def add_mtp_layer(src, num_layers: int) -> int:
    """Store a copy of the last decoder layer as the multi-token-prediction layer after it, as published
    (model.layers.<num_layers>.*, num_nextn_predict_layers=1); returns how many tensors it holds."""
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    layer = {k.replace(last, mtp): v.clone() for k, v in load_all(src).items() if k.startswith(last)}
    edit_tensors(src, lambda t: t.update(layer))
    edit_config(src, num_nextn_predict_layers=1)
    return len(layer)


def test_mtp_layer_is_left_out_with_a_line_and_only_the_router_and_its_bias_may_be_float32(tiny_glm, tmp_path, capfd):
    """As published: the MTP layer stored after the decoder layers (num_nextn_predict_layers, which HF's
    model ignores) is left out, saying so; the expert bias (and from transformers 5.24 the router weight,
    tests/test_float32_routers.py) is float32 among bf16 weights, converted as stored; any other float32
    tensor there is refused in one line."""
    src = tmp_path / "published"
    shutil.copytree(tiny_glm["glm4-moe-bf16"], src)
    stored = {k: v.dtype for k, v in load_all(src).items()}
    kept = ("e_score_correction_bias", "mlp.gate.weight") if "gate.weight" in installed_float32(
        family_named("glm4_moe")) else ("e_score_correction_bias",)
    assert {k for k, d in stored.items() if d == torch.float32} == {k for k in stored if k.endswith(kept)}
    mtp = add_mtp_layer(src, 4)
    out = hf_to_megatron(src, tmp_path / "out", tp=2, ep=2, progress=False)
    assert (f"multi-token-prediction layer(s) (num_nextn_predict_layers=1, {mtp} tensors from model.layers.4.) "
            "are left out") in capfd.readouterr().err
    assert set(load_all(megatron_to_hf(out, tmp_path / "back", progress=False))) == set(load_all(tiny_glm["glm4-moe-bf16"]))
    edit_config(src, num_nextn_predict_layers=0)
    convert_fails(src, tmp_path / "no-mtp", "says num_hidden_layers=4 but the weights hold 5 layers")
    edit_config(src, num_nextn_predict_layers=1)
    edit_tensors(src, lambda t: t.update({k: v.float() for k, v in t.items() if k.endswith("mlp.shared_experts.up_proj.weight")}))
    convert_fails(src, tmp_path / "f32-expert", r"tensor 'model.layers.1.mlp.shared_experts.up_proj.weight' is F32 but "
                  r"config.json says dtype bfloat16")


def native_check_case(tiny_glm, tmp_path) -> dict:
    """A case for tests.mp_workers:megatron_native_checks, run in the launch of
    tests/test_moe_dense_layers.py (process start-up dominates): our torch_dist written at TP2 x PP2 x EP2."""
    convert = lambda name, src=tiny_glm["glm4-moe"], **kw: str(hf_to_megatron(  # noqa: E731
        src, tmp_path / f"glm-{name}", progress=False, **kw))
    return {"dist": convert("dist", tp=2, pp=2, ep=2, fmt="torch_dist"), "te_torch": convert("te", layer_spec="te"),
            "bf16_dist": convert("bf16", src=tiny_glm["glm4-moe-bf16"], ep=2, fmt="torch_dist"),
            "resave": str(tmp_path / "glm-resaved")}


def assert_native_layout(result: dict) -> None:
    """megatron-core loads our torch_dist into a one-process model and saves the same tensors back, the
    expert bias included (float32, per MoE layer); `toolkit memory` counts the same parameters (the
    bias is a buffer, not one)."""
    aliases = {f"decoder.layers.{i}.pre_mlp_layernorm.weight": result["megatrons"][
        f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"] for i in (1, 2, 3)}
    assert result["ours"] == {**result["megatrons"], **aliases}
    assert {i: result["ours"].get(f"decoder.layers.{i}.mlp.router.expert_bias") for i in range(4)} == {
        0: None, **{i: ((12,), "torch.float32") for i in (1, 2, 3)}}
    spec = spec_from_config(make_config("glm4-moe").to_dict())[1]
    assert sorted(stage_param_numels(spec, 1, 1, 0)) == result["param_numels"]


# HF's routers counted per step, one forward per document: GLM-4.5 trains without a load-balancing loss
_routing_reference = routed_per_document


@pytest.mark.multiprocess
def test_tp2_pp2_dp2_ep2_fine_tune_matches_hf_and_routes_every_token_as_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 x EP2 with sequence parallelism (experts at expert TP 2) on a tiny
    fp32 GLM-4.5 (a dense first layer, 12 experts in 4 groups, 2 shared experts split over TP, per-head
    q/k norms, a random expert bias): HF's losses and gradient norms over 10 steps, every step's tokens
    per expert as HF's routers chose them (the trainer's padding excluded: megatron-core 0.16.1 failed
    on every such forward, toolkit/runtime/cpu_compat.py EXPERT_BIAS_MASK_SPOT), and the expert bias as
    loaded in the HF export (neither side updates it: HF's e_score_correction_bias is a buffer its
    training never changes, and the recipe leaves megatron-core's moe_router_bias_update_rate
    unused). Guard: the reference with the expert bias zeroed routes otherwise and is far off the run."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import family_finetune_parity

    reference = _routing_reference()
    run = family_finetune_parity(tmp_path, "glm4-moe", 8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: reference, export_hf=True, seed=80)
    print(f"GLM-4.5 TP2xPP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    moe_layers = [layer for layer in run.metrics[0]["tokens_per_expert"] if any(layer)]
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == reference.routing
    assert len(moe_layers) == 3
    exported, original = load_all(tmp_path / "run" / "hf"), load_all(run.hf)
    biases = [k for k in original if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(exported[k], original[k]) for k in biases)

    edit_tensors(run.hf, lambda t: [v.zero_() for k, v in t.items() if k.endswith("e_score_correction_bias")])
    unbiased = _routing_reference()
    off = differences(run.metrics, *hf_reference(run.hf, run.data, run.cfg, STEPS, step_loss=unbiased))
    print(f"guard, HF without the expert bias: {off[0]:.1e} / {off[1]:.1e}")
    assert unbiased.routing != reference.routing and off[0] > 100 * LOSS_TOLERANCE_FP32


def test_a_bf16_run_routes_in_float32_as_hf_unless_the_recipe_says_otherwise(tmp_path):
    """HF's sigmoid router computes its logits in float32 whatever the model's dtype
    (Glm4MoeTopkRouter.forward); the family sets moe_router_dtype fp32. Before, the recipe's unset
    moe.router_dtype overrode it with None: a bf16 run routed in bf16, choosing other experts than HF."""
    from tests.finetune_harness import recipe_config
    from toolkit.layouts import Layout
    from toolkit.train.build import model_config

    spec = spec_from_config(make_config("glm4-moe").to_dict())[1]
    for overrides, expected in (([], "fp32"), (["moe.router_dtype=fp64"], "fp64")):
        cfg = recipe_config(tmp_path, ["precision=bf16", *overrides])
        assert model_config(spec, cfg, Layout(1, 1, 128, 1), "local")[0].moe_router_dtype == expected, overrides
