"""Nemotron-H's layer stack: megatron-core's hybrid stack (HybridStack; MambaStack before 0.18:
toolkit/runtime/megatron_versions.py hybrid_stack_classes) of local (torch) modules, one spec per symbol of
the layer pattern (HF's hybrid_override_pattern / layers_block_type):

    M  MambaLayer: norm (toolkit/blocks/norms.py ConfigEpsRMSNorm), the Mamba-2 mixer (toolkit/blocks/mixer_mamba.py)
    *  TransformerLayer with input_layernorm and self-attention only: megatron-core's SelfAttention and
       DotProductAttention (through torch's SDPA, toolkit/blocks/attention_sdpa.py); no RoPE (the model's
       position_embedding_type 'none', as NemotronHAttention applies none)
    -  MLPLayer with pre_mlp_layernorm and the MLP only (NemotronHMLP: up_proj, relu^2, down_proj; megatron-core's
       squared_relu without a GLU)
    E  TransformerLayer with pre_mlp_layernorm and megatron-core's local MoE only (Nemotron 3's NemotronHMoE: router,
       SequentialMLP experts and the shared expert, each relu^2 without a GLU), its norm keyed as the MLP layer's

The stack builds its final norm as TENorm whatever the spec (0.19.2 models/hybrid/hybrid_block.py:215,
0.16.1 ssm/mamba_block.py:166), which raises without Transformer Engine: `buildable_hybrid_stack` makes it
the toolkit's RMSNorm while the model is built, where TE is missing.
"""

from __future__ import annotations

import contextlib

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.mixer_mamba import mamba_mixer_spec
from toolkit.blocks.norms import ConfigEpsRMSNorm, RMSNorm


def hybrid_stack_spec(conv_kernel: int, chunk_size: int, num_experts: int = 0):
    """The stack spec; `num_experts` routed experts in its E layers (0: a pattern without them)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from toolkit.blocks.attention_sdpa import with_sdpa_core_attention
    from toolkit.runtime.megatron_versions import hybrid_stack_classes

    stack, submodules = hybrid_stack_classes()
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=RMSNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    experts = {"moe_layer": ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=RMSNorm,
        mlp=get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))} if num_experts else {}
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=ConfigEpsRMSNorm, mixer=mamba_mixer_spec(conv_kernel, chunk_size), mamba_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))
    return ModuleSpec(module=stack, submodules=submodules(
        mamba_layer=mamba, attention_layer=with_sdpa_core_attention(attention), mlp_layer=mlp, **experts))


@contextlib.contextmanager
def buildable_hybrid_stack():
    """The stack's final norm (TENorm by name in its module) as the toolkit's RMSNorm while a model is built,
    where Transformer Engine is missing; with TE, TE's."""
    import importlib

    from megatron.core.extensions import transformer_engine

    from toolkit.runtime.megatron_versions import hybrid_stack_classes

    module = importlib.import_module(hybrid_stack_classes()[0].__module__)
    if transformer_engine.HAVE_TE:
        yield
        return
    real = module.TENorm
    module.TENorm = RMSNorm
    try:
        yield
    finally:
        module.TENorm = real
