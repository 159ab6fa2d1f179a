"""MiniMax-M2 (minimax_m2): GQA attention with q/k RMSNorms over the whole projection, RoPE on the first
rotary_dim of each head, and on every layer 256 (here 8) experts behind a sigmoid router whose expert bias
selects and whose top-k weights are always renormalised (toolkit/families/minimax_m2.py).

HF is the reference: megatron-core's router function gives HF's routing weights token for token (in
process); megatron-core loading our checkpoints at TP2 x PP2 x EP2 gives HF's logits within 1e-4 in fp32 (in
the one launch of tests/test_published_parity.py, with a guard: the expert bias dropped). Each piece is
guarded on HF's own model: switched off there, the logits move far past the tolerance, so the parity proves it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_convert_roundtrip import load_all
from tests.test_family_glm4_moe import mcore_router
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "minimax-m2"
BIAS, ROUTER = "block_sparse_moe.e_score_correction_bias", "block_sparse_moe.gate.weight"
# As the published checkpoints store them among bf16 (and FP8) weights
PUBLISHED_FLOAT32 = ("e_score_correction_bias", "gate.weight")


@pytest.fixture(scope="module")
def tiny_minimax(tmp_path_factory):
    """`minimax-m2`: fp32 (parity); `minimax-m2-bf16`: bf16 with the router and its bias in float32, as published."""
    root = tmp_path_factory.mktemp("minimax-m2")
    models = fp32_and_bf16_models(root, (VARIANT,), 90, 91)
    models[f"{VARIANT}-bf16"] = make_tiny_model(VARIANT, root / "bf16-published", dtype="bfloat16", seed=91,
                                                fp32_modules=PUBLISHED_FLOAT32)
    return models


def hf_router(config, weight, bias, x):
    """HF's routing weights per token and expert: MiniMaxM2TopKRouter itself."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    router = MiniMaxM2TopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(weight)
        _, weights, indices = router(x, bias)
    return torch.zeros(x.shape[0], config.num_local_experts).scatter(1, indices, weights)


@pytest.mark.parametrize("changes", [{}, {"num_experts_per_tok": 2}, {"num_experts_per_tok": 8, "num_local_experts": 16}])
def test_megatron_cores_sigmoid_router_gives_hf_routing_weights(changes):
    """MiniMaxM2TopKRouter and megatron-core's router function with our settings: the same experts and the
    same weights for 512 tokens, with a bias that changes the selection (bit for bit at k = 2, 3; within an ulp
    at k = 8, where HF's unsorted top-k sums the weights in another order)."""
    config = make_config(VARIANT, **changes)
    spec = spec_from_config(config.to_dict())[1]
    torch.manual_seed(0)
    x, weight = torch.randn(512, config.hidden_size), torch.randn(config.num_local_experts, config.hidden_size) * 0.15
    bias = torch.randn(config.num_local_experts) * 0.2
    hf = hf_router(config, weight, bias, x)
    ours = mcore_router(spec, weight, bias, x)
    assert torch.equal(ours > 0, hf > 0) and torch.allclose(ours, hf, rtol=0, atol=1e-7)
    assert torch.equal(ours, hf) or config.num_experts_per_tok == 8
    unbiased = hf_router(config, weight, torch.zeros_like(bias), x)
    assert ((unbiased > 0) != (hf > 0)).any(), "the bias must change which experts are chosen"


def test_settings_and_one_line_refusals(tmp_path):
    """The router in megatron-core's terms; each remote-code key at another value than the one HF's class computes,
    top-1 routing (megatron-core keeps the score, HF weighs 1) and router jitter refused in one line naming it."""
    settings = settings_for(spec_from_config(make_config(VARIANT).to_dict())[1]).transformer
    assert {k: settings[k] for k in ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                                     "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_router_topk",
                                     "moe_shared_expert_intermediate_size", "qk_layernorm", "moe_aux_loss_coeff")} == {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_num_groups": None,
        "moe_router_topk_scaling_factor": None, "moe_router_dtype": "fp32", "moe_router_topk": 3,
        "moe_shared_expert_intermediate_size": None, "qk_layernorm": True, "moe_aux_loss_coeff": 0.0}
    assert spec_from_config(make_config(VARIANT).to_dict())[1].rotary_percent == 0.5
    base = make_config(VARIANT).to_dict()
    for changes, line in (
            ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 cannot be mapped exactly to megatron-core: HF divides"),
            ({"scoring_func": "softmax"}, "minimax_m2 with scoring_func='softmax' cannot be mapped exactly"),
            ({"use_routing_bias": False}, "minimax_m2 with use_routing_bias=False cannot be mapped exactly"),
            ({"use_qk_norm": False}, "minimax_m2 with use_qk_norm=False cannot be mapped exactly"),
            ({"qk_norm_type": "per_head"}, "minimax_m2 with qk_norm_type='per_head' cannot be mapped exactly"),
            ({"shared_intermediate_size": 1536}, "minimax_m2 with shared_intermediate_size=1536 cannot be mapped exactly"),
            ({"attn_type_list": [1, 0, 1, 1]}, r"minimax_m2 with attn_type_list\[1\]=0 cannot be mapped exactly"),
            ({"router_jitter_noise": 0.1}, "minimax_m2 with router_jitter_noise=0.1 cannot be mapped exactly")):
        with pytest.raises(ConversionError, match=line) as refused:
            spec_from_config({**base, **changes})
        assert "\n" not in str(refused.value)
    src = make_tiny_model(VARIANT, tmp_path / "src", seed=1)
    edit_config(src, num_experts_per_tok=1)
    convert_fails(src, tmp_path / "out", "num_experts_per_tok=1 cannot be mapped exactly")


def test_the_published_configs_keys_read_as_transformers_reads_them():
    """The published file's top-level rotary_dim 64 of head_dim 128 is transformers' partial_rotary_factor 0.5
    (MiniMaxM2Config.convert_rope_params_to_dict); its rope_theta 5e6 the base."""
    from tests import published_corpus as corpus

    for name in ("minimax-m2.7", "minimax-m2.5"):
        cfg = corpus.config(name)
        from transformers import MiniMaxM2Config

        if "partial_rotary_factor" not in MiniMaxM2Config(**cfg).rope_parameters:  # transformers 5.17 ignores rotary_dim
            with pytest.raises(ConversionError, match="rotary_dim=8 \\(of head_dim 16\\), which the installed"):
                spec_from_config(cfg)
            continue
        spec = spec_from_config(cfg)[1]
        assert cfg["rotary_dim"] == spec.rotary_dim and spec.rotary_percent == 0.5 and spec.rope_theta == 5e6, name
        assert (spec.num_experts, spec.moe_topk, spec.moe_score_function, spec.moe_expert_bias) == (16, 8, "sigmoid", True)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_as_published_is_bit_exact_and_loads_in_transformers(tiny_minimax, tmp_path, fmt):
    """bf16 with the router weight and the expert bias in float32, as the published checkpoints store them, at
    TP2 x PP2 x EP2: every tensor back in its dtype, bit for bit, and MiniMaxM2ForCausalLM loads the export."""
    from transformers import AutoModelForCausalLM

    src = tiny_minimax[f"{VARIANT}-bf16"]
    original = load_all(src)
    assert {k for k, v in original.items() if v.dtype == torch.float32} == {
        k for k in original if k.endswith((BIAS, ROUTER))}
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    restored = load_all(megatron_to_hf(out, tmp_path / "h", progress=False))
    assert set(restored) == set(original)
    assert [k for k in original if not (restored[k].dtype == original[k].dtype and torch.equal(restored[k], original[k]))] == []
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "h", dtype=torch.float32)
    assert torch.equal(model.model.layers[1].mlp.e_score_correction_bias, original[f"model.layers.1.{BIAS}"]) 


def test_toolkit_memory_counts_the_tiny_and_the_published_sizes_as_hf_builds_them():
    """The whole-projection q/k norms, the router and the experts counted as HF's model (on the meta device) holds
    them, the expert bias a buffer: the tiny model, and MiniMax-M2.7 at its published sizes, 228,689,748,992
    parameters (with the 62 x 256 bias entries and the FP8 scales, the checkpoint's 228,703,644,928 tensor
    elements the report of index.json lists), 9.80B a token goes through without the embedding and output
    layer (the card's "230B total, 10B active")."""
    from transformers import MiniMaxM2Config

    from tests.test_memory_moe_families import hf_counts, published
    from toolkit.memory.params import active_params, total_params

    # rotary_dim as partial_rotary_factor, as transformers 5.24 reads it (5.17 ignores it; counts do not depend on it)
    sizes = {**published("minimax-m2.7"), "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                               "partial_rotary_factor": 0.5}}
    for cfg in (make_config(VARIANT), MiniMaxM2Config(**sizes)):
        spec = spec_from_config(cfg.to_dict())[1]
        assert (total_params(spec), active_params(spec)) == hf_counts(cfg)
    assert (total_params(spec), active_params(spec) - 2 * 200064 * 3072) == (228_689_748_992, 9_801_344_000)


# -- guards on HF's own model: each piece switched off moves the logits far past the tolerance --

def _per_head_norm(norm, heads: int):
    """q_norm / k_norm with the same weights, but normalising each head alone (Qwen3's kind of q/k norm)."""

    def forward(x):
        shaped = x.float().unflatten(-1, (heads, -1))
        normed = shaped * torch.rsqrt(shaped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return (norm.weight * normed.flatten(-2)).type_as(x)

    return forward


def _unrenormalised(router):
    """MiniMaxM2TopKRouter without dividing the k weights by their sum."""

    def forward(hidden_states, e_score_correction_bias):
        logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        scores = torch.sigmoid(logits.float())
        _, chosen = torch.topk(scores + e_score_correction_bias, router.top_k, dim=-1)
        return logits, scores.gather(1, chosen), chosen

    return forward


def test_each_piece_switched_off_in_hfs_model_moves_the_logits_past_100x_the_tolerance(tiny_minimax):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import reference_tokens

    src = tiny_minimax[VARIANT]
    tokens = reference_tokens(251, 2, 32)

    def logits(change=None, **config):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **config)
        if change:
            change(model)
        with torch.no_grad():
            return model(tokens, use_cache=False).logits

    def per_head(model):
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.forward = _per_head_norm(attn.q_norm, model.config.num_attention_heads)
            attn.k_norm.forward = _per_head_norm(attn.k_norm, model.config.num_key_value_heads)

    def unrenormalised(model):
        for layer in model.model.layers:
            layer.mlp.gate.forward = _unrenormalised(layer.mlp.gate)

    def unbiased(model):
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.zero_()

    reference = logits()
    moved = {"per-head q/k norms": logits(per_head), "top-k weights not renormalised": logits(unrenormalised),
             "expert bias dropped": logits(unbiased),
             "RoPE on the whole head": logits(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 1.0})}
    diffs = {piece: float((other - reference).abs().max()) for piece, other in moved.items()}
    print({k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(d > 100 * FP32_TOLERANCE for d in diffs.values()), diffs


def _dropped(models, tmp_path, piece: str):
    """A copy of the fp32 model with its expert bias zeroed, converted at TP2 x PP2 x EP2: far off HF's logits."""
    assert piece == "expert-bias"
    src = tmp_path / "minimax-no-bias"
    shutil.copytree(models[VARIANT], src)
    edit_tensors(src, lambda t: [v.zero_() for k, v in t.items() if k.endswith(BIAS)])
    return hf_to_megatron(src, tmp_path / "m-minimax-no-bias", tp=2, pp=2, ep=2, progress=False)


GUARDS = ("expert-bias",)


def parity_pairs(tiny_minimax, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py: the fp32 model as
    per-rank torch files and as torch_dist, then the guard; and how many must match."""
    pairs = [(tiny_minimax[VARIANT], hf_to_megatron(tiny_minimax[VARIANT], tmp_path / f"minimax-{fmt}", tp=2, pp=2, ep=2,
                                                    fmt=fmt, progress=False)) for fmt in ("torch", "torch_dist")]
    return pairs + [(tiny_minimax[VARIANT], _dropped(tiny_minimax, tmp_path, piece)) for piece in GUARDS], len(pairs)


def assert_guards_fail(reports) -> None:
    for piece, report in zip(GUARDS, reports):
        assert report.max_logit_diff > 100 * FP32_TOLERANCE and not report.ok, piece


# -- as published: FP8 weights with 128 x 128 block scales (here 16 x 16), fmt named as torch names it --

FP8_BLOCK = (16, 16)


def published_fp8(tiny_minimax, directory):
    """The bf16 model as MiniMax publishes it: every projection and expert float8_e4m3fn with float32 scales per
    block (toolkit/tinymodels.py quantize_fp8), the router and its bias float32, config.json's quantization_config
    as the published one writes it."""
    from toolkit.tinymodels import quantize_fp8

    shutil.copytree(tiny_minimax[f"{VARIANT}-bf16"], directory)
    quantize_fp8(directory, FP8_BLOCK)
    edit_config(directory, quantization_config={"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                                "weight_block_size": list(FP8_BLOCK),
                                                "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]})
    return directory


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_fp8_as_published_converts_to_the_reference_dequantization(tiny_minimax, tmp_path, fmt):
    """At TP2 x PP2 x EP2 every tensor of the round trip equals the block-by-block reference dequantization
    (tests/test_convert_fp8.py) bit for bit, the experts' w1 / w2 / w3 included; the float32 router and bias as
    stored. The logits of the converted checkpoint are checked against HF's in the launch of
    tests/test_published_parity.py (fp8_parity_pair)."""
    from tests.test_convert_fp8 import BLOCK, reference_dequantization

    assert BLOCK == FP8_BLOCK
    src = published_fp8(tiny_minimax, tmp_path / "fp8")
    stored = load_all(src)
    assert stored["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"model.layers.0.{ROUTER}"].dtype == stored[f"model.layers.0.{BIAS}"].dtype == torch.float32
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    restored = load_all(megatron_to_hf(out, tmp_path / "back", progress=False))
    expected = reference_dequantization(src / "model.safetensors")
    assert set(restored) == set(expected)
    assert [k for k in expected if not (restored[k].dtype == expected[k].dtype and torch.equal(restored[k], expected[k]))] == []


def fp8_parity_pair(tiny_minimax, tmp_path):
    """(HF, megatron) for the parity launch: the FP8 checkpoint converted at TP2 x PP2 x EP2, against HF's model of
    its dequantized weights (the reference dequantization, written as a bf16 checkpoint beside its config)."""
    from safetensors.torch import save_file

    from tests.test_convert_fp8 import reference_dequantization

    src = published_fp8(tiny_minimax, tmp_path / "minimax-fp8")
    reference = tmp_path / "minimax-fp8-dequantized"
    shutil.copytree(src, reference)
    save_file(reference_dequantization(src / "model.safetensors"), reference / "model.safetensors", metadata={"format": "pt"})
    edit_config(reference, quantization_config=None)
    return reference, hf_to_megatron(src, tmp_path / "m-minimax-fp8", tp=2, pp=2, ep=2, progress=False)


@pytest.mark.multiprocess
def test_tp2_pp2_dp2_ep2_fine_tune_matches_hf_and_routes_every_token_as_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 x EP2 with sequence parallelism (experts at expert TP 2) on the tiny fp32
    MiniMax-M2 (8 experts top-3 behind the sigmoid router with a random expert bias, whole-projection q/k norms
    split over TP, partial RoPE): HF's losses and gradient norms over 10 steps, every step's tokens per expert as
    HF's routers chose them, the expert bias as loaded in the HF export (neither side trains it: HF's is a buffer,
    megatron-core's moe_router_bias_update_rate is left unused). No load-balancing loss on either side (HF adds
    one only with output_router_logits). Guard: the reference with the expert bias negated routes otherwise and
    is far off the run (zeroed, it is 1.0e-3 off in loss: just past 100 x the tolerance, too close to hold)."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import family_finetune_parity, routed_per_document

    reference = routed_per_document()
    run = family_finetune_parity(tmp_path, VARIANT, 8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: reference, export_hf=True, seed=95)
    print(f"MiniMax-M2 TP2xPP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == reference.routing
    assert len(reference.routing[0]) == 4
    exported, original = load_all(tmp_path / "run" / "hf"), load_all(run.hf)
    biases = [k for k in original if k.endswith(BIAS)]
    assert len(biases) == 4 and all(torch.equal(exported[k], original[k]) for k in biases)

    edit_tensors(run.hf, lambda t: [v.neg_() for k, v in t.items() if k.endswith(BIAS)])
    unbiased = routed_per_document()
    off = differences(run.metrics, *hf_reference(run.hf, run.data, run.cfg, STEPS, step_loss=unbiased))
    print(f"guard, HF with the expert bias negated: {off[0]:.2e} / {off[1]:.2e}")
    assert unbiased.routing != reference.routing and off[0] > 100 * LOSS_TOLERANCE_FP32
