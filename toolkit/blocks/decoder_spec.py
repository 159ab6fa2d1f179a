"""The decoder layers and block of a family's own model: megatron-core's local (torch) modules and the
toolkit's blocks (this package), composed from the family's `CustomLayer` choices (toolkit/families/table.py);
what the spec cannot reach is hooked onto the built model (`adapt_model`).

A layer: input norm, self-attention (toolkit/blocks/attention_self.py; a gated delta net where the layer is
linear, toolkit/blocks/mixer_gated_delta_net.py, with norms of its own kind where CustomLayer.linear_layer says), the dense MLP or megatron-core's MoE module (Gemma 4's own,
toolkit/blocks/moe_layers.py), its post-norms in the output linears (toolkit/blocks/linears.py); q/k norms
as `CustomLayer.qk_norm` says: per head (RMSNorm), over the projection (ProjectionRMSNorm,
toolkit/blocks/norms.py), or Llama 4's L2 norm, megatron-core's own weightless L2Norm (transformer/torch_norm.py,
in 0.16.1 as in 0.19) per head, on the layers with RoPE only (HF builds Llama4TextL2Norm where use_rope): a
NoPE layer (megatron-core's no_rope_freq) gets IdentityOp there instead.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.attention_self import Gemma4SelfAttention, LayerRopeSelfAttention
from toolkit.blocks.linears import PostNormRowParallelLinear
from toolkit.blocks.mixer_gated_delta_net import gated_delta_net_spec
from toolkit.blocks.moe_layers import gemma4_moe_spec
from toolkit.blocks.norms import ProjectionRMSNorm, RMSNorm
from toolkit.families.spec import ModelSpec
from toolkit.families.table import CustomLayer


@functools.lru_cache(maxsize=None)
def _scaled_layer():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ScaledTransformerLayer(TransformerLayer):
        """A decoder layer whose output is multiplied by its `layer_scalar` (Gemma 4's stored buffer,
        not trained: requires_grad False)."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.layer_scalar = torch.nn.Parameter(torch.ones(1, dtype=config.params_dtype, device=device),
                                                   requires_grad=False)

        def forward(self, *args, **kwargs):
            output, context = super().forward(*args, **kwargs)
            return output * self.layer_scalar, context

    return ScaledTransformerLayer


def _qk_norm(kind: str | None, heads: int):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    if kind == "l2":
        from megatron.core.transformer.torch_norm import L2Norm

        return L2Norm
    if kind == "projection":
        return ModuleSpec(module=ProjectionRMSNorm, params={"heads": heads})
    return RMSNorm if kind == "head" else IdentityOp


def _mlp(config, out_linear, moe: bool):
    """The dense MLP, or megatron-core's own local MoE module (router, SequentialMLP experts, a
    shared expert where configured) in a Mixture-of-Experts layer; its output never post-normed."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if moe:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        if out_linear is not RowParallelLinear:
            raise NotImplementedError("a norm after a Mixture-of-Experts layer's output")
        return get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=out_linear))


def rope_bases(spec: ModelSpec) -> tuple:
    """Per layer: the windowed layers' own RoPE base, None where the model's applies."""
    if spec.window_rope_theta is None or not spec.window_layers:
        return ()
    return tuple(spec.window_rope_theta if c == "1" else None for c in spec.window_layers)


def stage_moe_layers(config) -> list[bool]:
    """Per layer this pipeline stage builds: whether it is a Mixture-of-Experts layer (the
    toolkit sets moe_layer_freq to 1 or to a list, toolkit/megatron_settings.py)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config)
    if not isinstance(config.moe_layer_freq, list):
        return [bool(config.num_moe_experts)] * count
    offset = get_transformer_layer_offset(config)
    return [bool(kind) for kind in config.moe_layer_freq[offset: offset + count]]


def stage_linear_layers(config) -> list[bool]:
    """Per layer this pipeline stage builds: whether it is a gated delta net (linear attention) layer
    (megatron-core's linear_attention_freq as a list, toolkit/families/qwen3_next.py)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config)
    if not isinstance(config.linear_attention_freq, list):
        return [False] * count
    offset = get_transformer_layer_offset(config)
    return [bool(kind) for kind in config.linear_attention_freq[offset: offset + count]]


def stage_nope_layers(config) -> list[bool]:
    """Per layer this pipeline stage builds: whether RoPE is skipped there (megatron-core's no_rope_freq as a
    list, toolkit/megatron_settings.py; SmolLM3's and Llama 4's NoPE layers)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config)
    if not isinstance(getattr(config, "no_rope_freq", None), list):
        return [False] * count
    offset = get_transformer_layer_offset(config)
    return [bool(kind) for kind in config.no_rope_freq[offset: offset + count]]


def _layer_qk_norm(spec: ModelSpec, layer: CustomLayer, nope: bool) -> str | None:
    """The q/k norm kind of one layer: Llama 4's L2 norm only where the layer has RoPE and the config says so."""
    if layer.qk_norm == "l2_rope":
        return "l2" if spec.qk_l2_norm and not nope else None
    return layer.qk_norm


def layer_spec(config, spec: ModelSpec, layer: CustomLayer, moe: bool = False, linear: bool = False,
               nope: bool = False):
    """One decoder layer of local (torch) megatron-core modules, with the family's choices; `linear`:
    a gated delta net in place of self-attention; `nope`: a layer without RoPE (its q/k norm as
    _layer_qk_norm says)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    if linear and layer.linear_layer:  # a gated delta net layer of its own make (OLMo-Hybrid's pre-norms)
        layer = layer.linear_layer
    pre_norm = RMSNorm if layer.pre_norms else IdentityOp
    out_linear = PostNormRowParallelLinear if layer.post_norms else RowParallelLinear
    gemma4_moe = layer.gemma4 and moe  # the MoE layer holds its own norms (Gemma4MoELayer)
    # The TE spec folds the pre-norms into the next linear; its names are the checkpoint's (as the local spec's map)
    keys_map = {"input_layernorm.": f"self_attention.{'in_proj' if linear else 'linear_qkv'}.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"} if layer.pre_norms else {}
    if layer.gemma4 and moe:
        keys_map.pop("pre_mlp_layernorm.", None)
    params = ({"layer_kinds": spec.linear_layers, "global_attention": spec.global_attention,
               "sliding_theta": spec.window_rope_theta} if layer.gemma4 else {"rope_bases": rope_bases(spec)})
    attention = ModuleSpec(
        module=Gemma4SelfAttention if layer.gemma4 else LayerRopeSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, **params},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=out_linear,
            q_layernorm=_qk_norm(_layer_qk_norm(spec, layer, nope), spec.num_heads),
            k_layernorm=_qk_norm(_layer_qk_norm(spec, layer, nope), spec.num_kv_heads),
        ),
    ) if not linear else gated_delta_net_spec(spec.linear_attention)
    return ModuleSpec(
        module=_scaled_layer() if layer.gemma4 else TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if gemma4_moe else pre_norm,
            mlp=gemma4_moe_spec(config) if gemma4_moe else _mlp(config, out_linear, moe),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def sequence_parallel_block_spec(config, layer):
    """A stock local-spec `layer` (or block of layers) with every torch norm (pre-norms, q/k norms,
    the final norm) replaced by RMSNorm, which sequence parallelism needs; only RMSNorm models get here."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if config.normalization != "RMSNorm":
        raise NotImplementedError(f"sequence parallelism with {config.normalization} on the local spec")
    layers = layer.layer_specs if isinstance(layer, TransformerBlockSubmodules) else [layer] * get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[_rmsnorm_layer(one) for one in layers], layer_norm=RMSNorm)


def _rmsnorm_layer(layer):
    from dataclasses import replace

    from megatron.core.transformer.identity_op import IdentityOp

    attention = layer.submodules.self_attention
    # multi-latent attention (MLASelfAttentionSubmodules) norms its query and key-value latents instead
    qk = {name: RMSNorm for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
          if getattr(attention.submodules, name, IdentityOp) is not IdentityOp
          and not _is_rmsnorm(getattr(attention.submodules, name))}  # ours already (LatentRMSNorm) stays
    attention = replace(attention, submodules=replace(attention.submodules, **qk))
    return replace(layer, submodules=replace(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm,
                                             self_attention=attention))


def _is_rmsnorm(module) -> bool:
    return isinstance(module, type) and issubclass(module, RMSNorm)


def block_spec(config, spec: ModelSpec, layer: CustomLayer):
    """This pipeline stage's layers and the final norm (which must be our RMSNorm too)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = list(zip(stage_moe_layers(config), stage_linear_layers(config), stage_nope_layers(config)))
    kinds = {kind: layer_spec(config, spec, layer, *kind) for kind in set(layers)}
    return TransformerBlockSubmodules(layer_specs=[kinds[kind] for kind in layers], layer_norm=RMSNorm)


def adapt_model(model, spec: ModelSpec, layer: CustomLayer) -> None:
    """What the block spec cannot reach: the embedding's output scale (first stage only), the final
    logits' soft-capping (last stage only)."""
    cap = spec.final_logit_softcapping
    if cap and getattr(model, "output_layer", None) is not None:
        def softcap(module, inputs, output):
            logits, bias = output  # HF: logits / cap, tanh, * cap (Gemma4ForCausalLM.forward)
            return torch.tanh(logits / cap) * cap, bias

        model.output_layer.register_forward_hook(softcap)
    if layer.embedding_scale and getattr(model, "embedding", None) is not None:
        normalizer = spec.hidden_size**0.5

        def scale(module, inputs, output):
            # HF: embed_scale cast to the weight dtype (Gemma3TextScaledWordEmbedding)
            return output * torch.tensor(normalizer, dtype=module.word_embeddings.weight.dtype, device=output.device)

        model.embedding.register_forward_hook(scale)
