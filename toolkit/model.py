"""Build a megatron-core GPTModel for a ModelSpec on the current TP/PP rank.

Every architecture setting comes from toolkit.megatron_settings (the one translation shared with
the checkpoint writers); this module adds only how the model runs here: parallel sizes, dtype,
no dropout, fused kernels on GPU. Loading a checkpoint into the model is toolkit.convert.load.

The Transformer Engine layer spec is used where CUDA is present and megatron-core's TE extension
imports (a TE wheel built for another torch is found by importlib but fails to import); otherwise
the local spec (always on CPU), and always under LoRA (`layer_spec_choice`). A family whose layer
the stock GPT spec cannot express (`Family.layer`) gets the toolkit's own block spec of local
modules on every device (toolkit/blocks/decoder_spec.py).
"""

from __future__ import annotations

import copy
import functools

import torch

from toolkit.errors import ConfigError
from toolkit.families import family_named
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout
from toolkit.megatron_settings import settings_for
from toolkit.blocks.router_losses import AuxLoss
from toolkit.runtime import megatron_versions


# megatron-core fuses the bias add and the activation only for these (transformer_config.py:1485:
# gelu, silu (swiglu), quick_gelu); the tanh-approximated gelu of Gemma 3 runs unfused.
FUSED_ACTIVATIONS = ("silu",)


@functools.cache
def te_status() -> tuple[bool, str]:
    """Whether megatron-core's Transformer Engine extension is usable, and why (or why not). TE's
    version is read from its package metadata first: one that the installed megatron-core was not
    built for is not imported at all (megatron_versions.TE_RANGES)."""
    version = megatron_versions.te_version()
    if version is not None:
        supported, line = megatron_versions.te_supported(version)
        if not supported:  # a layer built for another TE fails deep inside its forward, if at all
            return False, f"{line}: not a supported pair, so the local spec; install a TE in that range to run TE's"
    try:
        import transformer_engine  # noqa: F401 - its own error says what is wrong
        from megatron.core.extensions import transformer_engine as extension
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception as e:  # noqa: BLE001 - a TE built for another torch fails with ImportError or OSError
        return False, f"transformer_engine does not import ({type(e).__name__}: {e})"
    if not (extension.HAVE_TE and gpt_layer_specs.HAVE_TE):
        return False, "megatron-core's Transformer Engine extension did not import"
    return True, f"transformer_engine {version}"


def running_layer_spec() -> str:
    """The layer spec of a full fine-tune or a conversion check on this machine: "te" or "local"."""
    if not torch.cuda.is_available():
        return "local"
    return "te" if te_status()[0] else "local"


def layer_spec_choice(lora: bool = False, model: ModelSpec | None = None) -> tuple[str, str]:
    """(spec, why) for this run of `model`. LoRA runs the local spec: TE fuses the input norms into linear_qkv
    and linear_fc1 (TELayerNormColumnParallelLinear), where an adapter wrapping the linear would add
    B A x of the input before the norm, while PEFT adapts the normalised input. Multi-latent attention
    runs the local spec: its checkpoints are converted for it only (toolkit/families/mla.py)."""
    spec = running_layer_spec()
    why = te_status()[1] if torch.cuda.is_available() else "no CUDA"
    required = model.required_layer_spec if model is not None else None
    if required and required[0] != spec:
        return required[0], f"{model.family}: {required[1]} ({why})"
    if spec == "te" and lora:
        return "local", f"LoRA adapts the normalised input, which TE's fused-norm linears do not expose ({why})"
    return spec, why


def transformer_config(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32,
                       aux_loss: AuxLoss | None = None, layer_spec: str | None = None, **overrides):
    """`aux_loss`: the routers' load-balancing loss of a Mixture-of-Experts model (none by default);
    `layer_spec`: "te" or "local", by default running_layer_spec()."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_gpu = torch.cuda.is_available()
    layer_spec = layer_spec or running_layer_spec()
    kwargs = dict(
        settings_for(spec).transformer,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=spec.expert_tp(layout.tp),
        # a family's own block spec (toolkit/blocks/decoder_spec.py) builds local modules, SequentialMLP experts included
        moe_grouped_gemm=spec.is_moe and layer_spec == "te" and not family_named(spec.family).layer,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Fused kernels are CUDA-only (apex / TE); the unfused paths are numerically the reference.
        # (gpt-oss's clamped GLU fuses only with the experts' probabilities, not in a plain MLP: mlp.py:183-212)
        bias_activation_fusion=on_gpu and spec.activation in FUSED_ACTIVATIONS and spec.glu_clamp is None,
        masked_softmax_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **(aux_loss.config_fields() if aux_loss and spec.is_moe else {}),
    )
    if spec.dsa:  # its fused kernels where they are installed, else megatron-core's torch path
        from toolkit.blocks.attention_dsa import kernel_backend

        kwargs["dsa_kernel_backend"] = kernel_backend()
    kwargs.update(overrides)
    config = (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)
    for name, value in settings_for(spec).config_attributes.items():
        setattr(config, name, value)
    return config


def layer_spec_module(layer_spec: str, config, spec: ModelSpec | None = None):
    """megatron-core's layer spec for `config` (its q/k norm and normalization included), or the
    family's own block spec. megatron-core's local DotProductAttention runs through torch's fused
    attention (toolkit.blocks.attention_sdpa). Under context parallelism the local spec's attention is the
    toolkit's (toolkit.blocks.context_parallel); Transformer Engine's does CP itself."""
    from toolkit.blocks.attention_sdpa import with_sdpa_core_attention

    built = with_sdpa_core_attention(_layer_spec_module(layer_spec, config, spec))
    if config.context_parallel_size > 1 and layer_spec == "local":
        from toolkit.blocks.context_parallel import with_context_parallel_attention

        return with_context_parallel_attention(built)
    return built


def _layer_spec_module(layer_spec: str, config, spec: ModelSpec | None = None):
    from megatron.core.models.gpt import gpt_layer_specs

    family = family_named(spec.family) if spec else None
    if family and family.layer:
        from toolkit.blocks.decoder_spec import block_spec

        return block_spec(config, spec, family.layer)

    # Experts: TE's grouped GEMM on GPUs, SequentialMLP locally (the legacy GroupedMLP needs the
    # grouped_gemm package, which CPUs lack).
    experts = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if isinstance(config.moe_layer_freq, list):  # dense layers among MoE ones: megatron-core's spec per layer
        local = gpt_layer_specs.get_gpt_decoder_block_spec(_without_dsa(config), use_transformer_engine=layer_spec == "te",
                                                           normalization=config.normalization)
    elif layer_spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention, **experts)
    else:
        local = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization,
                                                         qk_layernorm=config.qk_layernorm,
                                                         multi_latent_attention=config.multi_latent_attention, **experts)
    if config.sequence_parallel and layer_spec == "local":  # its torch norms refuse SP (Transformer Engine's take it)
        from toolkit.blocks.decoder_spec import sequence_parallel_block_spec

        local = sequence_parallel_block_spec(config, local)
    if config.multi_latent_attention and layer_spec == "local":  # after SP's norms: its latent norms keep HF's eps
        from toolkit.blocks.attention_mla import with_mla_core_attention

        core = {}
        if getattr(config, "experimental_attention_variant", None) == "dsa":  # toolkit/blocks/attention_dsa.py
            from toolkit.blocks.attention_dsa import dsa_core_attention

            core = {"core": dsa_core_attention()}
        local = with_mla_core_attention(local, full_rank_query=config.q_lora_rank is None, **core)
    return local


def _without_dsa(config):
    """`config` as megatron-core's GPT layer specs take it: they refuse experimental_attention_variant 'dsa'
    (gpt_layer_specs.py:572), whose core attention is put into the MLA layers afterwards (toolkit/blocks/attention_dsa.py)."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return config
    plain = copy.copy(config)
    plain.experimental_attention_variant = None
    return plain


def build_gpt_model(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32, config=None, layer_spec=None,
                    aux_loss: AuxLoss | None = None, vp_stage: int | None = None):
    """GPTModel for this process's pipeline stage (parallel_state must be initialised), or a hybrid model's
    HybridModel (build_hybrid_model); `aux_loss`
    as in transformer_config (toolkit/blocks/router_losses.py), checked against the layout. `vp_stage`: which
    of this rank's virtual stages (interleaved pipeline, toolkit.train.virtual), or None.
    `layer_spec`: "te", "local" or a megatron-core spec; by default running_layer_spec()."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from toolkit.blocks.attention_mla import buildable_mla

    if spec.hybrid_pattern is not None:
        return build_hybrid_model(spec, layout, dtype, config, vp_stage)
    if aux_loss:
        aux_loss.check(layout.pp)
    megatron_versions.quiet_release_notices()  # GPTModel's deprecation from 0.19, chosen on purpose
    config = config or transformer_config(spec, layout, dtype, aux_loss)
    with buildable_mla(config):
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec_module(layer_spec or running_layer_spec(), config, spec)
            if layer_spec is None or isinstance(layer_spec, str) else layer_spec,
            vocab_size=layout.padded_vocab(spec.vocab_size),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            parallel_output=True,
            **settings_for(spec).gpt,
            **({} if vp_stage is None else {"vp_stage": vp_stage}),
        )
    layer = family_named(spec.family).layer
    if layer:
        from toolkit.blocks.decoder_spec import adapt_model

        adapt_model(model, spec, layer)
    if spec.longrope:
        from toolkit.blocks.rope_longrope import install_longrope

        install_longrope(model, spec, config.use_cpu_initialization)
    if aux_loss and spec.is_moe:
        aux_loss.install(model)
    if spec.attention_sinks:
        tag_sinks_split_over_tp(model)
    if torch.cuda.is_available():
        model.cuda()
    return model


def build_hybrid_model(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32, config=None,
                       vp_stage: int | None = None):
    """megatron-core's HybridModel (MambaModel before 0.18: megatron_versions.hybrid_model_class) for this
    process's pipeline stage, of the toolkit's local stack spec (toolkit/blocks/hybrid_spec.py) on every device,
    its layers ModelSpec.hybrid_pattern; megatron-core splits the pattern evenly over the stages, as
    Layout.stage_layers does (0.19.2 hybrid_layer_allocation.py select_pipeline_segment; 0.16.1 mamba_block.py
    _select_layers_for_pipeline_parallel). No virtual pipeline: megatron-core refuses it without '|' in the pattern."""
    from megatron.core import parallel_state as ps

    from toolkit.blocks.hybrid_spec import buildable_hybrid_stack, hybrid_stack_spec

    if vp_stage is not None:
        raise ConfigError(f"{spec.family}: no virtual pipeline stages (parallel.vpp) for a hybrid model: megatron-core "
                          "takes them only from '|' in its layer pattern")
    config = config or transformer_config(spec, layout, dtype, layer_spec="local")
    model_class, stack_argument, pattern_argument = megatron_versions.hybrid_model_class()
    gpt = settings_for(spec).gpt
    with buildable_hybrid_stack():
        model = model_class(
            config=config, vocab_size=layout.padded_vocab(spec.vocab_size),
            max_sequence_length=gpt["max_sequence_length"], position_embedding_type=gpt["position_embedding_type"],
            share_embeddings_and_output_weights=gpt["share_embeddings_and_output_weights"],
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(), parallel_output=True,
            **{stack_argument: hybrid_stack_spec(spec.mamba["conv_kernel"], spec.mamba["chunk_size"], spec.num_experts),
               pattern_argument: spec.hybrid_pattern})
    if torch.cuda.is_available():
        model.cuda()
    return model


def tag_sinks_split_over_tp(model) -> None:
    """The attention sinks (DotProductAttention.softmax_offset, one per head) are split over TP with the
    heads, but megatron-core 0.16.1 leaves them untagged (dot_product_attention.py:128): a gradient norm
    that counts an untagged parameter once per TP group (DeepSpeed's, stage_1_and_2.py:2682; megatron-core's
    param_is_not_tensor_parallel_duplicate) would leave out every other TP rank's sinks."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
