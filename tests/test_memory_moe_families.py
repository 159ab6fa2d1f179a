"""`toolkit memory` / `plan` on the 2025-2026 Mixture-of-Experts families (issue 26): multi-latent
attention (a low-rank or a full query, the latent norms, the RoPE head dims), the sigmoid router with
its expert bias (a buffer, not a parameter), shared experts, dense first layers, gpt-oss's sinks and
biases, GLM-4.5's partial rotary and attention biases.

The reference is HF's own model, built from transformers' classes on the meta device (no memory, in
process): our total count is sum(p.numel()) of its parameters, our active count the same with only
top-k of each layer's routed experts (HF's `mlp.experts.*` tensors, fused or per expert, scaled by
k / experts). The per-rank split (MLA's down projections are column-parallel under megatron-core's
local spec, the spec these checkpoints are written for) is checked against what the converter writes
for each TP x PP x EP rank in tests/test_family_deepseek_v3.py, checkpoints megatron-core's own
modules load at TP2 x PP2 x EP2 in tests/test_published_parity.py."""

from __future__ import annotations

import pytest
import torch

from tests.published_corpus import config, index
from toolkit.families import spec_from_config
from toolkit.layouts import Layout
from toolkit.memory.params import active_params, stage_buffer_bytes, stage_param_numels, total_params
from toolkit.tinymodels import make_config

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def hf_counts(cfg) -> tuple[int, int]:
    """(parameters, parameters a token goes through) of HF's model for the transformers config `cfg`,
    built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    experts = next(getattr(cfg, k) for k in EXPERT_COUNT_KEYS if getattr(cfg, k, None))
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        # the routed experts only: shared_experts and the router (mlp.gate / mlp.router) are whole
        active += p.numel() * cfg.num_experts_per_tok // experts if ".mlp.experts." in name else p.numel()
    return total, active


TINY = ("deepseek-v3", "deepseek-v3-full-q", "deepseek-v32", "glm-moe-dsa", "glm-moe-dsa-shared", "glm4-moe", "glm4-moe-air",
        "gpt-oss", "qwen3-next", "qwen3.5-moe",
        "nemotron-h")  # Nemotron-H: dense, its Mamba-2, attention and MLP layers each on their own layers


@pytest.mark.parametrize("variant", TINY)
def test_tiny_models_count_as_hf_builds_them(variant):
    """Every feature on (a dense first layer, shared experts, group-limited routing, the expert bias,
    sinks, biases, partial rotary, q/k norms; Qwen3-Next's gated delta net layers and output-gated attention
    layers, each on its own layers): the counts equal HF's, and the PP2 stages together hold
    the model once (the dense first layer on stage 0) plus the padded vocab rows."""
    cfg = make_config(variant)
    spec = spec_from_config(cfg.to_dict())[1]
    assert (total_params(spec), active_params(spec)) == hf_counts(cfg)
    padding = (Layout(1, 2).padded_vocab(spec.vocab_size) - spec.vocab_size) * spec.hidden_size * 2  # untied
    assert sum(sum(stage_param_numels(spec, 1, 2, s)) for s in (0, 1)) == total_params(spec) + padding


def test_the_expert_bias_is_a_float32_buffer_not_a_parameter():
    """DeepSeek-V3 / GLM-4.5's e_score_correction_bias is megatron-core's expert_bias buffer: no
    gradient, no optimizer state, so not in the parameter counts; the estimate holds it (and
    megatron-core's token counts beside it) as float32 buffers of every MoE layer of the stage."""
    spec = spec_from_config(make_config("deepseek-v3").to_dict())[1]  # layer 0 dense, 1-3 MoE, 12 experts
    assert [stage_buffer_bytes(spec, 2, s) for s in (0, 1)] == [1 * 2 * 4 * 12, 2 * 2 * 4 * 12]
    gpt_oss = spec_from_config(make_config("gpt-oss").to_dict())[1]  # softmax router, no expert bias
    assert stage_buffer_bytes(gpt_oss, 1, 0) == 0


def published(name: str) -> dict:
    """A published config.json of the corpus at its original sizes (tests/data/published_configs/index.json)."""
    return {**config(name), **index()[name]["original_sizes"]}


# GLM-4.5-Air (zai-org/GLM-4.5-Air): the sizes from slime's scripts/models/glm4.5-106B-A12B.sh (96 heads,
# 8 KV groups of 128, hidden 4096, FFN 10944, 1 dense + 45 MoE layers, 128 experts top-8 of width 1408,
# one shared expert of 1408, q/k/v biases, RoPE on half of each head, vocab 151552, untied; GitHub
# zyzshishui/slime_ @78327e3f), the rest as Glm4MoeConfig reads GLM-4.5's config.json (no q/k norms in
# Air, one expert group).
GLM45_AIR = dict(hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
                 num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=128,
                 num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
                 vocab_size=151552, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})


def _deepseek_config(cfg: dict):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "auto_map", "quantization_config")})


def _deepseek_v32_config(cfg: dict):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")})


def _qwen3_next_config(cfg: dict):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**cfg)


def _glm_config(cfg: dict):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**cfg)


# name -> (config.json, its transformers config, the model card's total (value, unit), its active
# billions, whether that active figure counts the embedding and output layer). The cards truncate:
# DeepSeek-V3 "671B total, 37B activated" (671.03B and 37.55B here; its MTP module, 14B more in the
# checkpoint, is not HF's model), Kimi-K2 "1 trillion total, 32 billion activated" (1.026T, 32.86B),
# GLM-4.5-Air "106 billion total, 12 billion active" (106.85B; 12.18B without the embedding and output
# layer, as GLM-4.5's "355B / 32B" counts too: 13.42B with them)
PUBLISHED = {
    "deepseek-v3": (published("deepseek-v3"), _deepseek_config, (671, 1e9), 37, True),
    # DeepSeek-V3.2-Exp: DeepSeek-V3 and 61 indexers of 13.96M (wq_b 1536 x 64 x 128, wk 7168 x 128, k_norm, weights_proj
    # 7168 x 64): 671.88B, 38.40B active; its card gives no total of its own (the hub's 685B is the checkpoint's, MTP
    # layer included, which HF's model ignores)
    "deepseek-v3.2-exp": (published("deepseek-v3.2-exp"), _deepseek_v32_config, (671, 1e9), 38, True),
    "kimi-k2-instruct": (published("kimi-k2-instruct"), _deepseek_config, (1, 1e12), 32, True),
    "glm-4.5-air": ({**GLM45_AIR, "model_type": "glm4_moe"}, _glm_config, (106, 1e9), 12, False),
    # "80B total parameters, only 3B active" (79.67B; 3.87B with the embedding and output layer, 3.25B without)
    "qwen3-next-80b-a3b-instruct": (published("qwen3-next-80b-a3b-instruct"), _qwen3_next_config, (79, 1e9), 3, False),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_sizes_count_as_hf_builds_them(name):
    cfg, hf_config, (card_total, unit), card_active, with_embeddings = PUBLISHED[name]
    spec = spec_from_config(cfg)[1]
    total, active = total_params(spec), active_params(spec)
    assert (total, active) == hf_counts(hf_config(cfg))
    embeddings = 0 if with_embeddings else 2 * spec.vocab_size * spec.hidden_size
    assert (int(total / unit), int((active - embeddings) / 1e9)) == (card_total, card_active), (total, active)


def test_plan_finds_an_expert_parallel_layout_for_deepseek_v3_on_32_nodes():
    """671B on 32 nodes x 8 x 80 GiB: its 61 layers allow no pipeline (PP 61 aside), so the experts
    spread over EP, and a layout fits without offload. The step time counts the 8 routed experts a
    token reaches: with all 256 it would be far slower (it was the same, 6 x 671B FLOPs per token, and
    offloading the optimizer ranked first)."""
    from dataclasses import replace

    from toolkit.memory import GIB
    from toolkit.plan import Cluster, plan
    from toolkit.throughput import step_time

    spec = spec_from_config(published("deepseek-v3"))[1]
    result = plan(spec, Cluster(256, 80 * GIB, 8), seq_len=4096, global_batch=256)
    best = result.best
    assert best is not None and result.fits_without_offload and not best.offloaded, result.advice
    assert best.memory.ep > 1 and best.memory.gpu_bytes <= 80 * GIB and "EP" in best.explain(result.cluster)
    top8, every_expert = (step_time(s, best.setup, 4096, best.recompute, 8).compute
                          for s in (spec, replace(spec, moe_topk=spec.num_experts)))
    assert top8 < every_expert / 10, (top8, every_expert)


def test_plan_prices_offload_on_a_pipeline_stage_without_experts():
    """The corpus's DeepSeek-V3 (4 layers, the first 3 dense) at PP 2: stage 0 holds no expert tensor.
    Pricing ZeRO-Offload for its (empty) expert group raised ValueError: max() arg is an empty sequence."""
    from toolkit.memory import GIB
    from toolkit.plan import Cluster, plan

    spec = spec_from_config(config("deepseek-v3"))[1]
    assert spec.moe_layers == "0001"
    result = plan(spec, Cluster(8, 80 * GIB, 4), seq_len=256, global_batch=16)
    assert any(c.setup.pp == 2 and c.memory.ep > 1 and c.offloaded for c in result.ranked)


def test_multi_latent_attention_is_priced_on_the_local_spec_it_runs_on_a_gpu_too():
    """The recipe runs MLA on megatron-core's local spec wherever it runs (its checkpoints are converted
    for it only): unfused attention, with its fp32 scores, and torch's norms, whatever --kernels says;
    a GPU's runtime reserve stays. (Its terms are measured in tests/test_memory_measured.py.)"""
    from toolkit.dsconfig import Setup
    from toolkit.memory import CPU_LOCAL, GPU, estimate

    spec = spec_from_config(make_config("deepseek-v3").to_dict())[1]
    setup = Setup(gpus=2, tp=1, pp=1, zero=1, precision="bf16", micro_batch=2, global_batch=4)
    on_gpu, local = (estimate(spec, setup, 32, kernels=k) for k in (GPU, CPU_LOCAL))
    assert not on_gpu.kernels.flash_attention and not on_gpu.kernels.fused_norm and on_gpu.kernels.fused_swiglu
    assert on_gpu.stages[0].reserve > 0 == local.stages[0].reserve
    fp32_scores = 4 * spec.num_heads * 2 * 32 * 32 * spec.num_layers
    assert local.stages[0].activations > on_gpu.stages[0].activations > fp32_scores  # the SwiGLU fused only


def test_qwen3_next_keeps_no_s_squared_terms_on_the_local_spec():
    """Qwen3-Next-80B at 16,384 tokens on megatron-core's local spec: its 12 attention layers run the
    fused SDPA (toolkit/blocks/attention_sdpa.py) and its 36 gated delta net layers the chunked rule (a
    [d_k, d_v] state per head and chunk of 64 tokens), so no layer keeps s^2 bytes: twice the tokens,
    twice the activations, per layer and in all. Guard: with attention sinks (which megatron-core's
    unfused DotProductAttention computes, with its fp32 scores) the 12 attention layers grow as s^2
    and the whole as more than 3x. (The gated delta net's terms are modelled on megatron-core's
    GatedDeltaNet with fla's kernels, not measured: the CPU runs the token-at-a-time torch rule.)"""
    import dataclasses

    from toolkit.dsconfig import Setup
    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.memory.activations import Shape, gated_delta_net_layer_bytes

    spec = spec_from_config(published("qwen3-next-80b-a3b-instruct"))[1]
    assert spec.linear_layers.count("1") == 36
    seq = 16384
    setup = Setup(gpus=8, tp=1, pp=1, zero=3, precision="bf16", micro_batch=1, global_batch=8)

    def activations(model) -> list[int]:
        return [estimate(model, setup, s, kernels=CPU_LOCAL).stages[0].activations for s in (seq, 2 * seq)]

    fused = activations(spec)
    assert fused[1] == 2 * fused[0], fused
    unfused = activations(dataclasses.replace(spec, attention_sinks=True))
    assert unfused[1] > 3 * unfused[0], unfused
    per_layer = [gated_delta_net_layer_bytes(spec, Shape(s, 1, 1, 2), CPU_LOCAL) for s in (seq, 2 * seq)]
    assert per_layer[1] == 2 * per_layer[0]
