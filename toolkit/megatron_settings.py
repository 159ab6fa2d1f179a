"""The one translation from a model (its family and ModelSpec) to megatron-core's settings.

The model builder (TransformerConfig fields and GPTModel arguments, toolkit/model.py) and the
checkpoint writers (the Megatron-LM `args` stored in every checkpoint) both read `settings_for`,
so the two cannot disagree. A family adds settings of its own (`Family.megatron`, e.g.
qk_layernorm) in the manner of Megatron-Bridge's provider per family.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toolkit.families import family_named
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout
from toolkit.runtime import megatron_versions

# The factor megatron-core uses when llama3 scaling is off: the default of GPTModel.__init__ and
# RotaryEmbedding (gpt_model.py:105, rotary_pos_embedding.py:66), as of Megatron-LM's
# --rope-scaling-factor. Checked against megatron-core's signature in tests/test_family_qwen3.py.
MCORE_ROPE_SCALING_FACTOR = 8.0
# Megatron-LM argument names of the settings whose TransformerConfig / GPTModel name differs
# (the inverse of Megatron-LM's core_transformer_config_from_args).
ARG_NAMES = {
    "layernorm_epsilon": "norm_epsilon",
    "gated_linear_unit": "swiglu",  # with activation_func silu, which args do not store
    "rope_scaling": "use_rope_scaling",
    "max_sequence_length": "max_position_embeddings",
    "num_moe_experts": "num_experts",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
}


def gelu_tanh(x):
    """HF's gelu_pytorch_tanh (Gemma's GeGLU)."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def _activation(name: str):
    import torch.nn.functional as F

    return {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}[name]


# HF's activations of an MLP without a gate: relu2 (Nemotron-H's NemotronHMLP), megatron-core's squared_relu
UNGATED_ACTIVATIONS = ("relu2",)


def glu_settings(spec: ModelSpec) -> dict:
    """The gated MLP: HF's activation, or gpt-oss's clamped SwiGLU as megatron-core's quick_gelu GLU
    with a clamp and an offset (mlp.py:219-226; toolkit/families/gpt_oss.py); an MLP without a gate for
    UNGATED_ACTIVATIONS (activations.py squared_relu)."""
    if spec.activation in UNGATED_ACTIVATIONS:
        from megatron.core.activations import squared_relu

        return {"activation_func": squared_relu, "gated_linear_unit": False}
    if spec.glu_clamp is None:
        return {"activation_func": _activation(spec.activation), "gated_linear_unit": True}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return {"activation_func": quick_gelu, "gated_linear_unit": True, "activation_func_clamp_value": spec.glu_clamp,
            "glu_linear_offset": spec.glu_offset}


@dataclass(frozen=True)
class MegatronSettings:
    transformer: dict  # TransformerConfig fields that describe the architecture
    gpt: dict  # GPTModel arguments that describe the architecture (the padded vocab is the layout's)
    # Attributes megatron-core reads from the TransformerConfig that are none of its fields (GPTModel's
    # yarn_*, gpt_model.py:172-190), set on the config once built, as Megatron-Bridge's providers do
    config_attributes: dict


def settings_for(spec: ModelSpec) -> MegatronSettings:
    transformer = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        **glu_settings(spec),
        add_bias_linear=spec.linear_bias,
        **({"softmax_type": "learnable"} if spec.attention_sinks else {}),
        add_qkv_bias=spec.qkv_bias,
        # HF: a token attends to `window` tokens including itself; megatron: (left, right) extra tokens.
        window_size=(spec.window_size - 1, 0) if spec.window_size else None,
        # per layer, 1 where the window applies (megatron-core's is_layer_window_attention)
        window_attn_skip_freq=[int(c) for c in spec.window_layers] if spec.window_layers else None,
        # per layer, 1 where RoPE is skipped (SmolLM3's NoPE layers; attention.py: rotary_pos_emb = None)
        **({"no_rope_freq": [int(c) for c in spec.nope_layers]} if spec.nope_layers else {}),
        softmax_scale=spec.softmax_scale,
        **({"qk_layernorm": True} if spec.qk_norm else {}),
        # Llama 4's weightless L2 q/k norm (its block spec puts L2Norm on the RoPE layers only, toolkit/blocks/decoder_spec.py)
        **({"qk_l2_norm": True} if spec.qk_l2_norm else {}),
        **family_named(spec.family).megatron,
        **moe_settings(spec),
        **linear_attention_settings(spec),
        **mamba_settings(spec),
    )
    transformer.update(mla_settings(spec))  # its kv_channels replaces the one above
    transformer.update(dsa_settings(spec))
    gpt = dict(
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        # GPTModel's own YaRN; multi-latent attention builds its own (mla_settings)
        position_embedding_type=("none" if spec.rope_theta is None  # no RoPE anywhere (gpt_model.py:99-101)
                                 else "yarn" if spec.yarn and not spec.mla else "rope"),
        rotary_base=spec.rope_theta,
        rotary_percent=spec.rotary_percent,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or MCORE_ROPE_SCALING_FACTOR,
        seq_len_interpolation_factor=spec.rope_linear_factor,
    )
    return MegatronSettings(transformer, gpt, dict(spec.yarn or {}) if not spec.mla else {})


def linear_attention_settings(spec: ModelSpec) -> dict:
    """Qwen3-Next's gated delta net layers (toolkit/families/qwen3_next.py) as TransformerConfig's fields
    (transformer_config.py:250, :275-294): per layer 1 for a gated delta net, 0 for attention."""
    if not spec.linear_attention:
        return {}
    la = spec.linear_attention
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[int(c) for c in spec.linear_layers], linear_conv_kernel_dim=la["conv_kernel"],
                linear_key_head_dim=la["k_dim"], linear_value_head_dim=la["v_dim"],
                linear_num_key_heads=la["k_heads"], linear_num_value_heads=la["v_heads"])


def mamba_settings(spec: ModelSpec) -> dict:
    """Nemotron-H's Mamba-2 mixers (toolkit/families/nemotron_h.py) as TransformerConfig's fields; the conv
    width and the scan's chunk are the mixer's constructor arguments instead (toolkit/blocks/mixer_mamba.py)."""
    if not spec.mamba:
        return {}
    m = spec.mamba
    return dict(mamba_state_dim=m["state"], mamba_head_dim=m["head_dim"], mamba_num_groups=m["groups"],
                mamba_num_heads=m["heads"])


def mla_settings(spec: ModelSpec) -> dict:
    """Multi-latent attention (toolkit/families/mla.py) as MLATransformerConfig's fields: the q / kv
    LoRA norms are its q_layernorm / kv_layernorm (built where qk_layernorm), RoPE (rope_type "rope")
    or YaRN ("yarn", toolkit/families/yarn.py) built by MLASelfAttention itself from these fields,
    not by GPTModel (gpt_model.py:159). kv_channels is unused by MLA's projections (they take the
    head dims below); v_head_dim, as Megatron-LM's DeepSeek-V3 recipes set it."""
    if not spec.mla:
        return {}
    m = spec.mla
    return dict(
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=m["q_lora_rank"],
        kv_lora_rank=m["kv_lora_rank"],
        qk_head_dim=m["qk_nope_head_dim"],
        qk_pos_emb_head_dim=m["qk_rope_head_dim"],
        v_head_dim=m["v_head_dim"],
        kv_channels=m["v_head_dim"],
        rotary_base=spec.rope_theta,
        rotary_percent=spec.rotary_percent,
        **(mla_yarn(spec.yarn) if spec.yarn else {"rope_type": "rope", "rotary_scaling_factor": 1.0}),
    )


def dsa_settings(spec: ModelSpec) -> dict:
    """DeepSeek Sparse Attention's indexer (toolkit/families/dsa.py) as TransformerConfig's dsa_* fields
    (megatron-core 0.19: transformer_config.py:303-343): HF's indexer leaves out DeepSeek's Hadamard rotation
    (orthonormal) and rotates half-split (GLM-5's interleaved), its k_norm a LayerNorm of eps 1e-6, its scores ReLU'd; no indexer loss
    (dsa_indexer_loss_coeff, off as HF trains none). Refused in one line before 0.19 (megatron_versions.dsa_exact)."""
    if not spec.dsa:
        return {}
    from toolkit.families.dsa import HF_INDEXER_K_NORM_EPS

    megatron_versions.require_exact_dsa()
    d = spec.dsa
    return dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=d["heads"], dsa_indexer_head_dim=d["head_dim"],
                dsa_indexer_topk=d["topk"], dsa_indexer_rotate_activation=False,
                dsa_indexer_rope_interleaved=d.get("rope_interleaved", False),
                dsa_indexer_scoring_relu=True, dsa_indexer_k_norm_epsilon=HF_INDEXER_K_NORM_EPS,
                # GLM-5's IndexShare (toolkit/families/glm_moe_dsa.py): a computing layer every freq after offset
                dsa_indexer_topk_freq=d.get("topk_freq", 1), dsa_indexer_skip_topk_offset=d.get("skip_topk_offset", 0))


def mla_yarn(yarn: dict) -> dict:
    """YaRN (toolkit/families/yarn.py's `yarn_*` attributes) as MLATransformerConfig's fields, which
    MLASelfAttention passes to YarnRotaryEmbedding (multi_latent_attention.py:138-149). mscale None where
    HF uses get_mscale(factor) alone, as megatron-core's _yarn_get_concentration_factor does; the softmax
    scale takes get_mscale(factor, mscale_all_dim)**2 (:125-126), 1 for mscale_all_dim 0, as HF's
    yarn_apply_mscale where mscale_all_dim is unset (the case with mscale_all_dim alone is refused:
    toolkit/families/mla.py)."""
    return {"rope_type": "yarn", "rotary_scaling_factor": yarn["yarn_rotary_scaling_factor"],
            "original_max_position_embeddings": yarn["yarn_original_max_position_embeddings"],
            "beta_fast": yarn["yarn_beta_fast"], "beta_slow": yarn["yarn_beta_slow"], "mscale": yarn["yarn_mscale"],
            "mscale_all_dim": yarn["yarn_mscale_all_dim"] or 0.0}


def moe_settings(spec: ModelSpec) -> dict:
    """The router HF uses, in megatron-core's terms (see toolkit/families/router.py): renormalised
    top-k is top-k of the logits then softmax (pre_softmax off); otherwise softmax then top-k. No
    score scaling, and no capacity factor, so no token is ever dropped. A shared expert is
    megatron-core's SharedExpertMLP, gated as HF's where the family says so."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function=spec.moe_score_function,
        moe_router_pre_softmax=not spec.moe_renormalise,
        moe_router_topk_scaling_factor=spec.moe_scaling_factor,
        **sigmoid_router_settings(spec),
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size or None,
        moe_shared_expert_gate=spec.moe_shared_expert_gate,
        # per layer 1 (MoE) or 0 (a dense MLP of ffn_hidden_size), gpt_layer_specs.py:583-597
        moe_layer_freq=[int(kind) for kind in spec.moe_layers] if spec.moe_layers else 1,
        **load_balancing_loss(spec),
    )


def sigmoid_router_settings(spec: ModelSpec) -> dict:
    """DeepSeek-V3 / GLM-4.5's router (toolkit/families/sigmoid_router.py): the expert bias as
    megatron-core's expert_bias buffer, group-limited top-k, and the router in fp32 as HF's."""
    if spec.moe_score_function != "sigmoid":
        return {}
    return dict(moe_router_enable_expert_bias=spec.moe_expert_bias, moe_router_num_groups=spec.moe_num_groups,
                moe_router_group_topk=spec.moe_group_topk, moe_router_dtype="fp32")


def load_balancing_loss(spec: ModelSpec) -> dict:
    """The router's auxiliary loss, with HF's coefficient (`router_aux_loss_coef`) in megatron-core's
    per-layer form (moe_utils.py switch_load_balancing_loss_func), summed over layers, per micro-batch:
        L = coeff * E / (k * T^2) * sum_i P_i * c_i   (T tokens of the micro-batch, c_i routed to
                                                       expert i, P_i their summed softmax scores)
    HF's load_balancing_loss_func pools all layers (T*L rows) and has no 1/k:
        L_HF = coeff * E * sum_i (c_i / (T*L)) * (P_i / (T*L)).
    Only in training with gradients (router.py:598); logits are unaffected."""
    return dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=spec.moe_aux_loss_coeff)


def megatron_args(spec: ModelSpec, layout: Layout, ckpt_format: str) -> argparse.Namespace:
    """The `args` Megatron-LM stores in every checkpoint and checks on load (check_checkpoint_args)."""
    import torch

    settings = settings_for(spec)
    named = {ARG_NAMES.get(k, k): v for k, v in {**settings.transformer, **settings.gpt, **settings.config_attributes}.items()
             if k != "activation_func"}
    named["untie_embeddings_and_output_weights"] = not named.pop("share_embeddings_and_output_weights")
    if spec.glu_clamp is not None:  # Megatron-LM's --quick-geglu (with the clamp and offset named as the config's)
        named["gated_linear_unit"], named["quick_geglu"] = named.pop("swiglu"), True
    elif spec.activation in UNGATED_ACTIVATIONS:  # Megatron-LM's --squared-relu, without --swiglu
        named["swiglu"], named["squared_relu"] = False, True
    elif spec.activation != "silu":  # Megatron-LM's `swiglu` means a gated silu; it has no flag for this one
        named["gated_linear_unit"], named["activation"] = named.pop("swiglu"), spec.activation
    if spec.hybrid_pattern:  # Megatron-LM's --hybrid-override-pattern
        named["hybrid_override_pattern"] = spec.hybrid_pattern
    dtype = getattr(torch, spec.dtype, torch.float32)
    return argparse.Namespace(
        **named,
        group_query_attention=spec.num_kv_heads != spec.num_heads,
        seq_length=spec.max_position_embeddings,
        add_position_embedding=False,
        vocab_size=spec.vocab_size,
        padded_vocab_size=layout.padded_vocab(spec.vocab_size),
        make_vocab_size_divisible_by=layout.vocab_divisor,
        tokenizer_type="HuggingFaceTokenizer",
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=spec.expert_tp(layout.tp),
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format=ckpt_format,
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )
