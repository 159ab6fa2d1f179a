"""Tiny, real Hugging Face checkpoints for the quickstart, the tests and the benchmarks.

Nothing can be fetched from a model hub here, so models are built from `transformers` configs
with random weights and saved with `save_pretrained`, together with a small word-level
tokenizer over digits. Norm weights and biases are randomised too, so a conversion that drops or
swaps them cannot pass a logit comparison by accident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# Tokens of the tokenizer shipped with every tiny model (digits and a few specials).
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
DIGITS = [str(d) for d in range(10)]
SEPARATOR = "="

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,  # divisible by PP = 1, 2, 3
    num_attention_heads=4,  # divisible by TP = 1, 2, 4
    num_key_value_heads=2,  # TP = 4 > 2 KV heads exercises megatron-core's QKV sub-sharding
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    vocab_size=256,
    tie_word_embeddings=False,
)

# Qwen3 with sizes a wrong mapping cannot hide behind: head_dim 12 where hidden / heads = 5, a
# GQA ratio of 6 (2 KV heads, fewer than TP 4), a vocab not a multiple of 8, an FFN of 96.
QWEN3 = dict(num_attention_heads=12, num_key_value_heads=2, head_dim=12, intermediate_size=96, vocab_size=251,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

# Mixture-of-Experts: top-2 of 6 (Mixtral) and of 8 (Qwen3-MoE) experts, so EP 2 gives 3 and 4 local
# experts; expert FFN widths (40, 36) unlike the dense intermediate_size; 4 layers for PP 2.
MIXTRAL = dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=2, intermediate_size=40, num_local_experts=6,
               num_experts_per_tok=2, num_hidden_layers=4, vocab_size=251, sliding_window=8)
QWEN3_MOE = dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=12, intermediate_size=96,
                 moe_intermediate_size=36, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 num_hidden_layers=4, vocab_size=251, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# Qwen2-MoE: 6 experts top-3 (3 per EP 2 rank) of width 36, not renormalised (the family's default,
# megatron-core's pre-softmax router), a shared expert of width 52 with its sigmoid gate, q/k/v biases.
QWEN2_MOE = dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96,
                 moe_intermediate_size=36, shared_expert_intermediate_size=52, num_experts=6, num_experts_per_tok=3,
                 norm_topk_prob=False, num_hidden_layers=4, vocab_size=251)
# OLMoE (64 experts top-8 there): 8 experts top-3 of width 44, renormalised, q/k norms over the whole
# projection with 2 KV heads (fewer than TP 4).
OLMOE = dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=2, intermediate_size=44, num_experts=8,
             num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=4, vocab_size=251)
# GLM-4.5 with every feature on: 12 experts in 4 groups of 3, the best 2 groups kept, top-4 (4 // 2 = 2,
# HF's top-2 group score: exact in megatron-core), 2 shared experts fused to width 48, the first
# layer dense (width 96; PP 2's first stage holds a dense and a MoE layer), a routed scaling of 2.5,
# RoPE on half of each head, per-head q/k norms, q/k/v biases; the expert bias is randomised too
# (EXPERT_BIAS_STD). GLM-4.5-Air-like: neither q/k norms nor biases, no group limit.
GLM4_MOE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                moe_intermediate_size=24, n_routed_experts=12, num_experts_per_tok=4, n_group=4, topk_group=2,
                n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                use_qk_norm=True, attention_bias=True, num_hidden_layers=4, vocab_size=251,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
# DeepSeek-V3 with every feature on: GLM-4.5's MoE layout above (12 experts in 4 groups, 2 kept, top-4,
# 2 shared experts, a dense first layer, scaling 2.5), multi-latent attention with a low-rank query of
# 48, a KV latent of 32, per head 16 + 8 query / key dims and 12 value dims (every size distinct), YaRN
# (factor 4 over 16 original positions, so the test sequences reach past them) with mscale 0.7 and
# mscale_all_dim 1 (cos and sin scaled by their ratio, the softmax by the latter's square). The second
# variant: a full-rank query (q_lora_rank null, as DeepSeek-V2-Lite) and plain RoPE. Weights of std 0.05
# (not 0.02) sharpen attention enough that dropping YaRN's mscales moves the logits 0.19 (2e-3 at 0.02).
DEEPSEEK_V3 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                   moe_intermediate_size=24, n_routed_experts=12, num_experts_per_tok=4, n_group=4, topk_group=2,
                   n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   num_hidden_layers=4, vocab_size=251, max_position_embeddings=64, initializer_range=0.05,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                    "mscale": 0.7, "mscale_all_dim": 1.0})
DEEPSEEK_V3_FULL_Q = dict(DEEPSEEK_V3, q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# DeepSeek-V3.2: DeepSeek-V3's MLA (a low-rank query, which its indexer reads), YaRN, sigmoid router with groups, expert
# bias and shared experts, a dense first layer, plus the lightning indexer of DeepSeek Sparse Attention: 4 heads of 16
# (RoPE on the first 8, qk_rope_head_dim) keeping the top 8 keys per query, fewer than the parity checks' 32 tokens
DEEPSEEK_V32 = dict(DEEPSEEK_V3, index_topk=8, index_head_dim=16, index_n_heads=4)
# GLM-5: DeepSeek-V3.2's modules with its indexer's RoPE interleaved, rms_norm_eps 1e-5 as published (its latent norms
# keep 1e-6), one expert group as published, plain RoPE
GLM_MOE_DSA = dict(DEEPSEEK_V32, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GLM4_MOE_AIR = dict(GLM4_MOE, use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1)
# gpt-oss with every piece in play: 8 experts top-3 (4 per EP 2 rank) of width 24, a SwiGLU limit of
# 1.5 that the larger weights (initializer_range 0.1) cross often (transformers before 5.19 fixes it at
# the published 7.0, toolkit/families/gpt_oss.py: there the model says so), windows of 8 (shorter than the test
# sequences) on every other layer, YaRN interpolating all but the fastest frequency (16 original
# positions, factor 32, truncate false as published) with its attention factor 1 + 0.1 ln 32; the
# sinks, the router and its bias randomised far from HF's init (SINK_STD, ROUTER_STD).
GPT_OSS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=24,
               num_local_experts=8, num_experts_per_tok=3, num_hidden_layers=4, vocab_size=251, sliding_window=8,
               swiglu_limit=1.5, initializer_range=0.1, max_position_embeddings=512,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
# Attention-sink logits of this spread take a good share of each softmax (HF initialises them at 0.02)
SINK_STD = 1.5
# Expert biases of this spread move the sigmoid scores' ranking, so they decide routing for some tokens
EXPERT_BIAS_STD = 0.2
# Router weights this large give logits of about unit spread: routing depends on them, and
# renormalising the top-2 probabilities (or not) changes the output (the parity guard).
ROUTER_STD = 0.15
# Phi-3: fused HF qkv_proj / gate_up_proj, GQA ratio 3 (Phi-3-mini itself is MHA), a window of 8
PHI3 = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=4, intermediate_size=96, vocab_size=251,
            sliding_window=8)
# Phi-4-mini (HF Phi3 classes) shrunk: RoPE on 12 of each head's 16 dimensions (partial_rotary_factor
# 0.75, as Phi-4-mini's 96 of 128), GQA ratio 3 (24 over 8 there), tied embeddings, a window longer
# than any sequence (262144 there), odd vocab and FFN; plain RoPE (its LongRoPE: PHI4_MINI_LONGROPE).
PHI4_MINI = dict(hidden_size=192, num_attention_heads=12, num_key_value_heads=4, intermediate_size=200, vocab_size=247,
                 partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=262144)
# LongRoPE (Phi-3.5-mini, Phi-4-mini: 4096 pretraining positions of 131072) with the switch point
# inside the test sequences' reach: Phi-3 past it (16 of 128 positions: long factors on the
# parity test's 32 tokens), Phi-4-mini before it (48: short factors), each with factors that
# differ per frequency, the attention factor sqrt(1 + ln(128 / 16) / ln(16)) and
# sqrt(1 + ln(128 / 48) / ln(48)) from the positions' ratio as published.
PHI3_LONGROPE = dict(PHI3, original_max_position_embeddings=16, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7],
    "long_factor": [1.5, 4.0, 9.0, 20.0]})
PHI4_MINI_LONGROPE = dict(PHI4_MINI, original_max_position_embeddings=48, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.1, 1.4, 2.0, 3.1, 5.0], "long_factor": [1.2, 2.0, 4.5, 9.0, 16.0, 30.0]})
# Gemma 3 with everything that differs from Llama in play: head_dim 24 where hidden / heads = 18,
# one KV head (GQA 4, fewer KV heads than TP 2 and 4), sqrt(72) not exact in bf16, local layers
# (window 8, shorter than the test sequences) with their own RoPE base between global ones with
# linear scaling, a softmax scale of 20 ** -0.5 (not head_dim's), tied embeddings as every Gemma 3.
GEMMA3 = dict(hidden_size=72, num_attention_heads=4, num_key_value_heads=1, head_dim=24, intermediate_size=96,
              vocab_size=251, sliding_window=8, query_pre_attn_scalar=20, tie_word_embeddings=True,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
# OLMo 2: GQA 6 (2 KV heads, fewer than TP 4: the whole-projection k norm spans replicated heads)
OLMO2 = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=2, intermediate_size=96, vocab_size=251)
# OLMo 3: OLMo 2's sizes, windows of 8 (shorter than the test sequences) on layers 0-2 and 4-5 (Olmo3Config's
# default, every 4th layer full: each PP 2 / PP 3 stage holds windowed layers, one a full one), YaRN on the
# full-attention layer only (16 original positions, factor 4, the attention factor written out as published:
# 1 + 0.1 ln 4), the windowed layers' plain RoPE of another base; weights of std 0.1 sharpen attention so that
# YaRN on every layer (transformers 5.2's regression) moves the logits far past the parity tolerance.
OLMO3 = dict(OLMO2, sliding_window=8, initializer_range=0.1, max_position_embeddings=64,
             rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "attention_factor": 1.138629436111989},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# SmolLM3: GQA 2, NoPE every 3rd layer (no_rope_layer_interval 3, the list left to SmolLM3Config: layers 2 and 5,
# one per PP 2 stage), tied embeddings as the published 3B
SMOLLM3 = dict(no_rope_layer_interval=3, tie_word_embeddings=True, vocab_size=251, initializer_range=0.1)

# Norm weights drawn from U(low, high), so a dropped or swapped norm cannot pass a logit comparison.
# Gemma's and Qwen3-Next's norms apply 1 + w: w around zero gives the same spread of scales, 0.5 to 1.5
# (gemma3: the multimodal wrapper, whose language model is Gemma 3's).
NORM_WEIGHTS = {"gemma3_text": (-0.5, 0.5), "gemma3": (-0.5, 0.5), "qwen3_next": (-0.5, 0.5),
                **dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"), (-0.5, 0.5))}
DEFAULT_NORM_WEIGHTS = (0.5, 1.5)
# Gemma 4 applies w, with a softmax scale of 1 after its q/k norms, so q.k grows with their weights squared: weights
# in (0.25, 0.75) keep the tiny models' attention about as sharp as 1/sqrt(head_dim) would (with (0.5, 1.5) its
# residual stream's rounding grows past 1e-4 over six layers at TP 2, the logits still within 6e-6)
NORM_WEIGHTS.update(dict.fromkeys(("gemma4_text", "gemma4"), (0.25, 0.75)))

# Mamba-2's per-head scalars (Nemotron-H), drawn so that each moves the output: A = -exp(A_log) in (-1, -0.05) and dt =
# softplus(.. + dt_bias) mostly in (0.1, 0.7) give decays that keep the state for tens of tokens (HF's A_log = log(1..h)
# and dt of 0.001-0.1 at init barely move the tiny model's loss), dt kept far above HF's clamp at time_step_min 1e-3
# (toolkit/blocks/mixer_mamba.py); D around zero, each head's skip its own. name ending -> (draw, low, high)
MAMBA_DRAWS = {"nemotron_h": {"A_log": ("log_uniform", 0.05, 1.0), "dt_bias": ("uniform", -2.0, 0.0),
                              "D": ("uniform", -1.0, 1.0)}}

# Qwen3-Next with every feature on: gated delta net layers (2 key heads of 8, 4 value heads of 12: two per
# key head; conv kernel 4) alternating with output-gated attention layers (full_attention_interval 2, so
# each PP 2 stage holds both), 6 experts top-2 renormalised (3 per EP 2 rank) with a gated shared expert
# of width 40, a dense first layer (mlp_only_layers), partial rotary 0.25 of head_dim 16.
QWEN3_NEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                  norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=4, full_attention_interval=2,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  linear_conv_kernel_dim=4, vocab_size=251,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

# Qwen3.5 with every feature on: Qwen3-Next's layers (gated delta net with 2 key heads of 8 serving 4 value
# heads of 12, conv 4, between output-gated attention layers every 2nd) with partial rotary 0.25 of head_dim
# 32 (8 rotated dimensions, 4 frequencies) and an interleaved MRoPE whose sections [2, 1, 1] give the H and W
# streams a frequency each; the MoE variant with 6 experts top-2 (always renormalised) and a gated shared
# expert of width 40 on every layer.
QWEN3_5 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
               num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, vocab_size=251,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_MOE = {**{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}, "moe_intermediate_size": 24,
               "shared_expert_intermediate_size": 40, "num_experts": 6, "num_experts_per_tok": 2}
# OLMo-Hybrid with every piece in play: gated delta net layers (2 key heads of 8, 4 value heads of 12: two per key
# head; conv kernel 4; beta doubled, linear_allow_neg_eigval as published) alternating with OLMo 3's attention layers
# (GQA 2 of 4 heads, q/k norms over the projection, post-norms) so each PP 2 stage holds both; RoPE on the attention
# layers (the published checkpoint has none: tests/data/published_configs/olmo-hybrid-7b.json); weights of std 0.1
# so that the doubled beta and RoPE matter past the parity tolerance.
OLMO_HYBRID = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, vocab_size=251, initializer_range=0.1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Mistral 4 with every feature on: DeepSeek-V3's multi-latent attention sizes above, YaRN as published (mscale and
# mscale_all_dim 1: cos and sin unscaled, the softmax by get_mscale(4, 1) squared) over 64 original positions with
# the Llama-4 query scale (beta 0.1, exactly 1 below those 64, past the test sequences); 8 experts top-3 (4 per EP 2
# rank) renormalised, routed scaling 1.5 (1.0 as published, which would hide it), 2 shared experts, a dense first
# layer, no groups (as published); weights of std 0.05 as DeepSeek-V3's.
MISTRAL4 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                num_hidden_layers=4, vocab_size=251, max_position_embeddings=256, initializer_range=0.05,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})

# Ministral 3 as published in kind: GQA 2 of 4 heads of an explicit head_dim 24 (not hidden / heads = 16), YaRN
# (factor 4 over 64 original positions, mscale = mscale_all_dim = 1 as published) with the Llama-4 query scale (beta
# 0.1, exactly 1 below those 64, past the test sequences); weights of std 0.1 sharpen attention so that the YaRN
# frequencies matter on them.
MINISTRAL3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=251, max_position_embeddings=256,
                  initializer_range=0.1,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})
# Gemma 4 with every feature the published 31B / 26B-A4B use on: sliding layers (window 8, shorter than the
# test sequences; 4 KV heads of 16, GQA 2, RoPE base 1e4) between global ones with their own head size and KV
# heads (2 of 32, GQA 4) whose keys are their values (attention_k_eq_v) and whose proportional RoPE turns a
# quarter of each head (4 of 16 frequencies, base 1e6); final logits soft-capped at 0.75 (30 as published, a cap
# the tiny model's logits reach); no per-layer input embeddings (0, as published). layer_scalar randomised.
GEMMA4 = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=96, vocab_size=251,
              sliding_window=8, final_logit_softcapping=0.75, hidden_size_per_layer_input=0, tie_word_embeddings=True,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}})

# Gemma 4's MoE block (the 26B-A4B's): beside each layer's dense MLP, 8 experts of width 24, top-2 (4 per EP 2
# rank), with the router's scale and per-expert scale randomised
GEMMA4_MOE = dict(GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)

# MiniMax-M2 with every piece in play: 8 experts top-3 (4 per EP 2 rank) of width 24, sigmoid scores with a
# random expert bias (EXPERT_BIAS_STD) choosing among them, always renormalised; q/k norms over the whole
# projection of 6 heads / 2 KV heads of 16 (split over TP ranks); RoPE on 8 of each head's 16 dimensions
# (rotary_dim, as the published 64 of 128) at base 10,000 so the short test sequences rotate; the remote-code
# keys of the published config at their values; no load-balancing loss (HF adds one only with output_router_logits).
MINIMAX_M2 = dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=16, intermediate_size=24,
                  num_local_experts=8, num_experts_per_tok=3, num_hidden_layers=4, vocab_size=251, rotary_dim=8,
                  router_aux_loss_coef=0.0, scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True,
                  qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1, 1, 1],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
# Llama 4 with every piece in play: MoE on layers 1 and 3 (interleave_moe_layer_step 2: each PP 2 stage holds a
# dense and a MoE layer) of 4 experts top-1 (2 per EP 2 rank) with the shared expert; NoPE on layer 2, the L2 q/k
# norm on the RoPE layers 0, 1, 3; chunks of 64 and the NoPE temperature (floor_scale 64) both beyond the test
# sequences (exact up to 63 tokens); weights of std 0.1 so routing and the q/k norm matter past the tolerance.
LLAMA4 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=24,
              intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=4,
              interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], use_qk_norm=True, attention_chunk_size=64,
              attn_temperature_tuning=True, floor_scale=64, attn_scale=0.1, vocab_size=251, initializer_range=0.1,
              max_position_embeddings=256, router_aux_loss_coef=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Nemotron-H with every piece of its dense layers in play: Mamba-2 (4 heads of 16, 2 B/C groups of state 8: TP 2
# splits heads and groups alike; conv kernel 4; chunks of 16, shorter than the test sequences), attention (GQA 2 of 4
# heads of 16, no RoPE) and relu^2 MLP layers, the pattern M-*M*- putting each kind on both PP 2 stages; the gated
# norm's eps at megatron-core's fixed 1e-5 (toolkit/families/nemotron_h.py). num_hidden_layers is the pattern's.
NEMOTRON_H = dict(hidden_size=64, hybrid_override_pattern="M-*M*-", mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                  ssm_state_size=8, conv_kernel=4, chunk_size=16, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=251, layer_norm_epsilon=1e-5, initializer_range=0.1)
# name -> (config class name, overrides)
VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-odd-vocab": ("LlamaConfig", {"vocab_size": 250}),  # not a multiple of 128: padding
    "llama3-scaled": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
         "max_position_embeddings": 16384,
         # The scaling only touches wavelengths > 2048 positions (megatron-core fixes the llama3
         # parameters), so on 32 tokens it barely matters to near-uniform attention (logits move
         # 3e-5 without it). Sharper attention (init std 0.1, not 0.02) makes dropping it move
         # the logits 1.5e-2, far past the fp32 parity tolerance (test_convert_parity.py guard).
         "initializer_range": 0.1},
    ),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),  # shorter than the test sequences
    "qwen3": ("Qwen3Config", QWEN3),
    "qwen3-tied": ("Qwen3Config", {**QWEN3, "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", MIXTRAL),
    "qwen3-moe": ("Qwen3MoeConfig", QWEN3_MOE),
    "qwen2-moe": ("Qwen2MoeConfig", QWEN2_MOE),
    "olmoe": ("OlmoeConfig", OLMOE),
    # Dense MLP layers (width intermediate_size 96) among the MoE ones: the first two (DeepSeek-V3's
    # first_k_dense_replace in Qwen3-MoE's terms: a pipeline stage of PP 2 without experts), and
    # every other one (Qwen2-MoE's decoder_sparse_step 2)
    "qwen3-moe-dense-layers": ("Qwen3MoeConfig", {**QWEN3_MOE, "mlp_only_layers": [0, 1]}),
    "qwen2-moe-sparse-step": ("Qwen2MoeConfig", {**QWEN2_MOE, "decoder_sparse_step": 2}),
    "glm4-moe": ("Glm4MoeConfig", GLM4_MOE),
    "glm4-moe-air": ("Glm4MoeConfig", GLM4_MOE_AIR),
    "deepseek-v3": ("DeepseekV3Config", DEEPSEEK_V3),
    "deepseek-v3-full-q": ("DeepseekV3Config", DEEPSEEK_V3_FULL_Q),
    "deepseek-v32": ("DeepseekV32Config", DEEPSEEK_V32),
    "glm-moe-dsa": ("GlmMoeDsaConfig", GLM_MOE_DSA),
    # IndexShare: layers 1 and 3 reuse the top-k of layers 0 and 2 (each pipeline stage of PP 2 begins with a full one)
    "glm-moe-dsa-shared": ("GlmMoeDsaConfig", {**GLM_MOE_DSA, "indexer_types": ["full", "shared", "full", "shared"]}),
    "phi3": ("Phi3Config", PHI3),
    "phi4-mini": ("Phi3Config", PHI4_MINI),
    "phi3-longrope": ("Phi3Config", PHI3_LONGROPE),
    "phi4-mini-longrope": ("Phi3Config", PHI4_MINI_LONGROPE),
    # One KV head, fewer than TP = 2: megatron-core all-gathers the fused QKV and re-slices it
    "qwen3-1kv": ("Qwen3Config", {**QWEN3, "num_key_value_heads": 1}),
    "phi3-1kv": ("Phi3Config", {**PHI3, "num_key_value_heads": 1}),
    "gemma3": ("Gemma3TextConfig", GEMMA3),
    "olmo2": ("Olmo2Config", OLMO2),
    "olmo3": ("Olmo3Config", OLMO3),
    "smollm3": ("SmolLM3Config", SMOLLM3),
    "gpt-oss": ("GptOssConfig", GPT_OSS),
    "qwen3-next": ("Qwen3NextConfig", QWEN3_NEXT),
    "qwen3.5": ("Qwen3_5TextConfig", QWEN3_5),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", QWEN3_5_MOE),
    "gemma4": ("Gemma4TextConfig", GEMMA4),
    "gemma4-moe": ("Gemma4TextConfig", GEMMA4_MOE),
    "mistral4": ("Mistral4Config", MISTRAL4),
    "minimax-m2": ("MiniMaxM2Config", MINIMAX_M2),
    "ministral3": ("Ministral3Config", MINISTRAL3),
    "llama4": ("Llama4TextConfig", LLAMA4),
    "olmo-hybrid": ("OlmoHybridConfig", OLMO_HYBRID),
    "nemotron-h": ("NemotronHConfig", NEMOTRON_H),
}


# A text tokenizer for tiny models (chat data in words): one token per printable ASCII character,
# ChatML's turn markers, and the specials; 104 tokens, within the tiny models' vocabularies.
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
TEXT_CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]


def build_tokenizer(text: bool = False):
    """Digits only (the quick start's task), or with `text` every printable character and ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = CHATML_TOKENS + TEXT_CHARACTERS if text else DIGITS + [SEPARATOR]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(symbols)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if text:
        core.add_special_tokens(CHATML_TOKENS)
        core.decoder = decoders.Fuse()  # characters joined as they were, not with spaces
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def _as_the_installed_model_computes(cls_name: str) -> dict:
    """Values of a variant that the installed transformers' model fixes whatever its config says."""
    if cls_name == "GptOssConfig":
        from toolkit.families.gpt_oss import FIXED_BEFORE_TRANSFORMERS_5_19, installed_transformers_reads_swiglu

        return {} if installed_transformers_reads_swiglu() else FIXED_BEFORE_TRANSFORMERS_5_19
    return {}


def make_config(variant: str, **overrides):
    import transformers

    cls_name, variant_overrides = VARIANTS[variant]
    kwargs = {**BASE, **variant_overrides, **_as_the_installed_model_computes(cls_name), **overrides}
    kwargs.setdefault("bos_token_id", 1)
    kwargs.setdefault("eos_token_id", 2)
    kwargs.setdefault("pad_token_id", 0)
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model(variant: str, directory: str | Path, dtype: str = "float32", seed: int = 0,
                    fp32_modules: Sequence[str] | None = None, **overrides) -> Path:
    """Create and save a tiny random model of `variant`; returns its directory. `fp32_modules`: the
    `_keep_in_fp32_modules_strict` to save with (None: the installed class's), to save as another
    transformers release does."""
    return save_random_model(make_config(variant, **overrides), directory, dtype, seed, fp32_modules)


def save_random_model(config, directory: str | Path, dtype: str = "float32", seed: int = 0,
                      fp32_modules: Sequence[str] | None = None) -> Path:
    """Save a random model of a transformers config (norms, routers and biases randomised too)
    with the digit tokenizer; returns its directory."""
    import torch
    import transformers

    from toolkit.convert.wrapper import wrapper_for
    from toolkit.families.hf_values import auto_causal_lm

    # a multimodal wrapper as its own class (AutoModelForCausalLM builds Qwen3.5's language model alone from it)
    wrapper = wrapper_for({"model_type": config.model_type})
    torch.manual_seed(seed)
    model = (getattr(transformers, wrapper.architecture)(config) if wrapper
             else auto_causal_lm().from_config(config))
    return _save_randomised(model, config.model_type, directory, dtype, fp32_modules)


def _save_randomised(model, model_type: str, directory: str | Path, dtype: str,
                     fp32_modules: Sequence[str] | None = None) -> Path:
    import torch

    from toolkit.families import HF_FLOAT32_BUFFERS

    low, high = NORM_WEIGHTS.get(model_type, DEFAULT_NORM_WEIGHTS)
    mamba = MAMBA_DRAWS.get(model_type, {})
    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = mamba.get(name.rpartition(".")[2])
            if drawn:
                kind, lo, hi = drawn
                param.copy_(param.uniform_(lo, hi).log() if kind == "log_uniform" else param.uniform_(lo, hi))
            elif "norm" in name:
                param.uniform_(low, high)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "shared_expert_gate.weight",
                                "feed_forward.router.weight")):
                param.normal_(0.0, ROUTER_STD)  # a MoE router, a shared expert's gate
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's router scales (ones at init)
                param.uniform_(*DEFAULT_NORM_WEIGHTS)
            elif name.endswith("self_attn.sinks"):  # gpt-oss's attention sinks
                param.normal_(0.0, SINK_STD)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            # DeepSeek-V3 / GLM-4.5's expert bias (zeros at init); MiniMax-M2's, `mlp.` in the model, `block_sparse_moe.` saved
            if name.endswith(HF_FLOAT32_BUFFERS + ("mlp.e_score_correction_bias",)):
                buffer.normal_(0.0, EXPERT_BIAS_STD)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (ones at init)
                buffer.uniform_(*DEFAULT_NORM_WEIGHTS)
    model = model.to(getattr(torch, dtype))
    # As transformers loads and saves them: the modules it keeps in float32 whatever the dtype (the expert
    # bias of DeepSeek-V3 / GLM-4.5, their router from transformers 5.24) stay float32, so a bf16 model holds
    # float32 tensors, as published
    kept = getattr(model, "_keep_in_fp32_modules_strict", None) if fp32_modules is None else fp32_modules
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if any(pattern in name for pattern in kept or ()):
            tensor.data = tensor.data.float()
    directory = Path(directory)
    model.save_pretrained(directory)
    if model_type == "olmo_hybrid":
        as_olmo_hybrid_publishes(directory, model.config)
    build_tokenizer().save_pretrained(directory)
    return directory


def as_olmo_hybrid_publishes(directory: Path, config) -> None:
    """Rewrite transformers' save of an OLMo-Hybrid model as the published checkpoints hold it (transformers'
    convert_olmo_hybrid_weights_to_hf.py; toolkit/families/olmo_hybrid.py): save_pretrained reverses the conversion
    mapping by cutting the concatenated conv1d into three equal chunks and names the attention layers'
    post_attention_layernorm feedforward_layer_norm; published, q/k/v_conv1d are the key, key and value channels
    and the attention layers keep post_attention_layernorm. transformers loads both forms to the same model."""
    import torch
    from safetensors.torch import load_file, save_file

    (path,) = directory.glob("*.safetensors")
    tensors = load_file(path)
    key_size = config.linear_num_key_heads * config.linear_key_head_dim
    value_size = config.linear_num_value_heads * config.linear_value_head_dim
    for layer, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{layer}."
        if kind == "full_attention":
            tensors[prefix + "post_attention_layernorm.weight"] = tensors.pop(prefix + "feedforward_layer_norm.weight")
            continue
        convs = [prefix + f"linear_attn.{p}_conv1d.weight" for p in "qkv"]
        whole = torch.cat([tensors.pop(name) for name in convs])
        tensors.update(zip(convs, (t.clone() for t in whole.split([key_size, key_size, value_size]))))
    save_file(tensors, path, metadata={"format": "pt"})


# A SigLIP vision tower as small as the class allows: one layer, 2 x 2 patches of 14 pixels
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


def make_tiny_gemma3_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, **text_overrides) -> Path:
    """Gemma 3 as its 4B / 12B / 27B are published (Gemma3ForConditionalGeneration: the tiny Gemma 3
    text model under `language_model`, a vision tower and projector beside it), from transformers'
    own config classes; returns its directory."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = make_config("gemma3", **text_overrides)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=SiglipVisionConfig(**TINY_VISION).to_dict(),
                          mm_tokens_per_image=4)
    torch.manual_seed(seed)
    return _save_randomised(Gemma3ForConditionalGeneration(config), text.model_type, directory, dtype)


# Gemma 4's vision tower as small as the class allows: one layer of width 32, patches of 4 pixels
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)


def make_tiny_gemma4_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, **text_overrides) -> Path:
    """Gemma 4 as its 31B / 26B-A4B are published (Gemma4ForConditionalGeneration: the tiny `gemma4` text model
    under `model.language_model`, a vision tower under `model.vision_tower`, its projection under
    `model.embed_vision`, no audio tower), from transformers' own config classes; returns its directory."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    text = make_config("gemma4", **text_overrides)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=Gemma4VisionConfig(**GEMMA4_VISION).to_dict(),
                          audio_config=None)
    torch.manual_seed(seed)
    return _save_randomised(Gemma4ForConditionalGeneration(config), text.model_type, directory, dtype)


# Qwen3.5's vision tower as small as the class allows: one block of width 32, a 4 x 4 grid of position embeddings
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                      num_position_embeddings=16)


def make_tiny_qwen3_5_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, moe: bool = False,
                                 **text_overrides) -> Path:
    """Qwen3.5 / 3.6 as published (Qwen3_5ForConditionalGeneration, or Qwen3_5MoeForConditionalGeneration with
    `moe`: the tiny `qwen3.5` / `qwen3.5-moe` text model under `model.language_model`, `lm_head` beside it, a
    vision tower under `model.visual`), from transformers' own config classes; returns its directory."""
    import torch
    import transformers

    text = make_config("qwen3.5-moe" if moe else "qwen3.5", **text_overrides)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text.to_dict(), vision_config={**QWEN3_5_VISION, "out_hidden_size": text.hidden_size},
        tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    return _save_randomised(getattr(transformers, f"{name}ForConditionalGeneration")(config), config.model_type,
                            directory, dtype)


# Pixtral's vision tower as small as the class allows: one layer of width 16, 4 x 4 patches of 8 pixels
PIXTRAL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                      image_size=32, patch_size=8)


def make_tiny_mistral3_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0,
                                  text_variant: str = "mistral4", **text_overrides) -> Path:
    """Mistral Small 4 as published (Mistral3ForConditionalGeneration: the tiny `mistral4` text model under
    `language_model.model`, its untied head as `language_model.lm_head`, a Pixtral tower and projector beside
    them), or Ministral 3 with `text_variant` "ministral3", from transformers' own config classes; returns its
    directory."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    text = make_config(text_variant, **text_overrides)
    config = Mistral3Config(text_config=text.to_dict(), vision_config=PixtralVisionConfig(**PIXTRAL_VISION).to_dict(),
                            tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    return _save_randomised(Mistral3ForConditionalGeneration(config), config.model_type, directory, dtype)


# Qwen3-VL's language models: the tiny Qwen3 / Qwen3-MoE with an interleaved MRoPE whose sections [2, 2, 2] give the
# H and W streams two of the 6 frequencies of head_dim 12 each (T keeps 0 and 3)
QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 2], "mrope_interleaved": True}
QWEN3_VL = {**QWEN3, "rope_parameters": QWEN3_VL_ROPE}
QWEN3_VL_MOE = {**{k: v for k, v in QWEN3_MOE.items() if k != "norm_topk_prob"}, "rope_parameters": QWEN3_VL_ROPE}
# Qwen3-VL's vision tower as small as the class allows: one block of width 32, a 4 x 4 grid of position embeddings,
# its DeepStack mergers after that block; 16-pixel patches as the tiny processor's (QWEN3_VL_PATCH), so that the
# processor's pixel values run through it
QWEN3_VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                       num_position_embeddings=16, deepstack_visual_indexes=[0])
# The ids of Qwen's vision tokens (QWEN_VL_TOKENS) in the tiny processor's tokenizer, as the wrapper's config names them
QWEN3_VL_TOKEN_IDS = dict(vision_start_token_id=102, vision_end_token_id=103, image_token_id=104, video_token_id=105)


def make_tiny_qwen3_vl_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, moe: bool = False,
                                  as_saved: bool = False, vision_overrides: dict | None = None,
                                  **text_overrides) -> Path:
    """Qwen3-VL as published (Qwen3VLForConditionalGeneration, or Qwen3VLMoeForConditionalGeneration with `moe`: the
    tiny Qwen3 / Qwen3-MoE text model with MRoPE under `model.language_model`, `lm_head` beside it, a vision tower
    under `model.visual`), from transformers' own config classes; returns its directory. The MoE experts are fused
    as published (gate_up_proj [E, hidden, 2 x ffn], down_proj [E, ffn, hidden]: toolkit/families/qwen3_vl.py), or
    with `as_saved` as transformers' save_pretrained writes them (the module's [E, 2 x ffn, hidden] / [E, hidden, ffn]).
    Its vision tokens are the tiny processor's (make_tiny_qwen3_vl_processor); `vision_overrides`: of the tower's config."""
    import torch
    import transformers

    name = "Qwen3VLMoe" if moe else "Qwen3VL"
    vision_overrides = vision_overrides or {}
    text = {**BASE, **(QWEN3_VL_MOE if moe else QWEN3_VL), "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            **text_overrides}
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config={**QWEN3_VL_VISION, "out_hidden_size": text["hidden_size"], **vision_overrides},
        tie_word_embeddings=text["tie_word_embeddings"], **QWEN3_VL_TOKEN_IDS)
    torch.manual_seed(seed)
    directory = _save_randomised(getattr(transformers, f"{name}ForConditionalGeneration")(config), config.model_type,
                                 directory, dtype)
    if moe and not as_saved:
        from safetensors.torch import load_file, save_file

        file = Path(directory) / "model.safetensors"
        tensors = load_file(file)
        for k in [k for k in tensors if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
    return directory


# Qwen3-VL's vision tokens (Qwen3VLProcessor finds them by these names), added to the text tokenizer as specials
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's published chat template without its vision ids and videos: ChatML, the default system prompt, each
# image part one <|image_pad|> between <|vision_start|> and <|vision_end|> (the processor expands it to the image's tokens)
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3-VL's 16-pixel patches merged 2 x 2 (as published), so an image is a multiple of 32 pixels a side and each
# 32 x 32 block one token; 1 to 16 tokens an image keeps the tiny images tiny (published: 256 to 16384)
QWEN3_VL_PATCH = 16
QWEN3_VL_PIXELS = dict(min_pixels=32 * 32, max_pixels=16 * 32 * 32)


def make_tiny_qwen3_vl_processor(directory: str | Path) -> Path:
    """Qwen3-VL's processor from transformers' classes (Qwen3VLProcessor over Qwen2VLImageProcessor's defaults, with
    Qwen3-VL's patch size and few pixels, and Qwen3VLVideoProcessor, which it requires and which needs torchvision)
    with the text tokenizer and Qwen's vision tokens; saved so that AutoProcessor loads it; returns its directory."""
    import transformers

    tokenizer = build_tokenizer(text=True)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(patch_size=QWEN3_VL_PATCH, **QWEN3_VL_PIXELS),
        tokenizer=tokenizer, video_processor=transformers.Qwen3VLVideoProcessor(), chat_template=QWEN_VL_CHAT_TEMPLATE)
    processor.save_pretrained(str(directory))
    return Path(directory)


# GLM-4.5V's language model: the tiny GLM-4.5 without q/k norms (its class has none), MRoPE sections [2, 1, 1] over
# the 4 frequencies of its 8 rotated dimensions (H and W a frequency each)
GLM4V_MOE = {**{k: v for k, v in GLM4_MOE.items() if k != "use_qk_norm"},
             "rope_parameters": {**GLM4_MOE["rope_parameters"], "mrope_section": [2, 1, 1]}}
# GLM-4.6V-Flash / GLM-4.1V's dense language model (glm4v_text): heads 16 wide (hidden // heads, the only head size
# Glm4vTextAttention has), RoPE on half of each (8 dims: 4 frequencies, MRoPE sections [2, 1, 1] giving H and W one
# each), an FFN of 96 fused as gate_up_proj, 4 layers for PP 2; its four norms and q/k/v biases are randomised. Sharper
# attention (init std 0.1, as llama3-scaled's) so that RoPE's layout shows in the logits: at 0.02 rotating every
# dimension instead of half moves them 9e-3, under the guards' 100x the parity tolerance
GLM4V = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=4,
             vocab_size=251, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                              "mrope_section": [2, 1, 1]})
# GLM-4.5V's vision tower as small as the class allows: one block of width 32, 2 x 2 patches of 14 pixels
GLM4V_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, image_size=28)


def make_tiny_glm4v_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, glm46v: bool = False,
                               dense: bool = False, **text_overrides) -> Path:
    """GLM-4.5V as published (Glm4vMoeForConditionalGeneration), or GLM-4.6V with `glm46v` (Glm46VForConditionalGeneration
    around the same glm4v_moe_text model); with `dense`, the dense glm4v_text model instead: GLM-4.6V-Flash with
    `glm46v`, GLM-4.1V-9B (Glm4vForConditionalGeneration) without. The tiny text model under `model.language_model`,
    `lm_head` beside it, a vision tower under `model.visual`, from transformers' own config classes; returns its
    directory."""
    import torch
    import transformers

    text_type = "glm4v_text" if dense else "glm4v_moe_text"
    text = {**BASE, **(GLM4V if dense else GLM4V_MOE), "model_type": text_type, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, **text_overrides}
    vision = {**GLM4V_VISION, "out_hidden_size": text["hidden_size"], "model_type": "glm4v_vision" if glm46v or dense
              else "glm4v_moe_vision"}
    name = "Glm46V" if glm46v else "Glm4v" if dense else "Glm4vMoe"
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision,
                                                     tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(seed)
    return _save_randomised(getattr(transformers, f"{name}ForConditionalGeneration")(config), config.model_type,
                            directory, dtype)


# Kimi-K2.5's vision tower as small as the class allows: one layer of width 32, a 4 x 4 grid of position embeddings
KIMI_K25_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                       pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)


def make_tiny_kimi_k25_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, **text_overrides) -> Path:
    """Kimi-K2.5 as published (Kimi_K25ForConditionalGeneration: the tiny DeepSeek-V3 text model under
    `language_model.model.layers.*`, `language_model.lm_head` beside it, a vision tower and projector), its text_config's
    model_type `kimi_k2` as published (Kimi_K25Config reads it as deepseek_v3), from transformers' own config classes;
    returns its directory."""
    import json

    import torch
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = {**BASE, **DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            **text_overrides}
    config = Kimi_K25Config(text_config=dict(text), vision_config=KIMI_K25_VISION, projection_hidden_size=32,
                            tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(seed)
    directory = _save_randomised(Kimi_K25ForConditionalGeneration(config), config.model_type, directory, dtype)
    file = Path(directory) / "config.json"
    saved = json.loads(file.read_text())
    saved["text_config"]["model_type"] = "kimi_k2"
    file.write_text(json.dumps(saved, indent=2) + "\n")
    return kimi_k25_layers_as_published(directory)


def kimi_k25_layers_as_published(directory: str | Path) -> Path:
    """transformers 5.24 reverses its unanchored `blocks` -> `layers` rename (meant for the vision tower) on save, so
    it writes the language model's layers as `language_model.model.blocks.*`; the published files (and its load,
    which renames them back) have `language_model.model.layers.*`: renamed so in the saved file."""
    from safetensors.torch import load_file, save_file

    weights = Path(directory) / "model.safetensors"
    tensors = load_file(weights)
    save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in tensors.items()},
              weights, metadata={"format": "pt"})
    return Path(directory)
# Llama 4's vision tower as small as the class allows: one layer of width 32, 2 x 2 patches of 14 pixels
LLAMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def make_tiny_llama4_multimodal(directory: str | Path, dtype: str = "float32", seed: int = 0, **text_overrides) -> Path:
    """Llama 4 Scout / Maverick as published (Llama4ForConditionalGeneration: the tiny `llama4` text model under
    `language_model.model`, its head as `language_model.lm_head`, a vision model and projector beside them), from
    transformers' own config classes; returns its directory."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = make_config("llama4", **text_overrides)
    config = Llama4Config(text_config=text.to_dict(), vision_config=LLAMA4_VISION, boi_token_index=248,
                          eoi_token_index=249, image_token_index=250, tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    return _save_randomised(Llama4ForConditionalGeneration(config), text.model_type, directory, dtype)


# DeepSeek-V3's FP8 checkpoints quantize every projection (attention and MLP, routed and shared experts) and
# keep the embeddings, norms, routers and head as they are
FP8_QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight",
                 ".w1.weight", ".w2.weight", ".w3.weight")  # MiniMax-M2's experts, stored as Mixtral's
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(directory: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Rewrite a saved tiny model as DeepSeek-V3 publishes its weights: each projection float8_e4m3fn with a
    float32 `weight_scale_inv` per block (its largest magnitude over 448, as DeepSeek's act_quant scales),
    the last blocks cut at the tensor's edge; config.json with DeepSeek-V3's quantization_config."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(FP8_QUANTIZED)]:
        weight = tensors[name].float()
        grid = [-(-size // b) for size, b in zip(weight.shape, block)]
        scale = torch.empty(grid, dtype=torch.float32)
        quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                scale[i, j] = weight[rows, cols].abs().max().clamp(min=1e-12) / FP8_MAX
                quantized[rows, cols] = (weight[rows, cols] / scale[i, j]).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = quantized, scale
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


# gpt-oss's fused expert weights as published: MXFP4 codes in blocks of 32 sharing an E8M0 scale byte
MXFP4_FUSED = ("experts.gate_up_proj", "experts.down_proj")
MXFP4_BLOCK = 32
# scale bytes 2 ** (s - 127) of 2^-9 .. 2^-6: random codes (magnitudes up to 6) give weights of an initialised
# model's spread (0.02), so logits stay small enough for the fp32 parity bar
MXFP4_SCALES = (118, 122)


def quantize_mxfp4(directory: str | Path, seed: int = 7) -> dict:
    """Replace a saved tiny gpt-oss's fused expert weights by random MXFP4 ones, as gpt-oss publishes them:
    `<name>_blocks` [E, out, in / 32, 16] uint8 (two codes a byte) and `<name>_scales` [E, out, in / 32]
    uint8; returns {name: (blocks, scales)}. The caller writes quantization_config (quant_method mxfp4)."""
    import torch
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    generator, packed = torch.Generator().manual_seed(seed), {}
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(MXFP4_FUSED)]:
        experts, inner, outer = tensors.pop(name).shape
        shape = (experts, outer, inner // MXFP4_BLOCK)
        packed[name] = (torch.randint(0, 256, (*shape, MXFP4_BLOCK // 2), generator=generator, dtype=torch.uint8),
                        torch.randint(*MXFP4_SCALES, shape, generator=generator, dtype=torch.uint8))
        tensors.update({name + "_blocks": packed[name][0], name + "_scales": packed[name][1]})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return packed
