"""Decoder-layer pieces megatron-core 0.16.1's stock GPT spec lacks, as megatron-core modules, and
the block spec that composes them from a family's `CustomLayer` choices (toolkit/families/table.py).

- RMSNorm: computed in fp32 as HF's Gemma 3 and OLMo 2 norms are, with the weight applied as
  (1 + w) where the config says layernorm_zero_centered_gamma (Megatron-LM's --apply-layernorm-1p,
  which Transformer Engine's norms honour and the local spec's WrappedTorchNorm refuses,
  transformer/torch_norm.py:26). The checkpoint keeps HF's w itself, so no rounding of 1 + w.
  It also runs under sequence parallelism, which WrappedTorchNorm refuses (torch_norm.py:32):
  its weight is tagged `sequence_parallel` as megatron-core's own norms tag theirs, so that its
  gradient, partial on each TP rank, is summed over TP (toolkit.train.parallel).
- PostNormRowParallelLinear: a RowParallelLinear whose output (after the TP all-reduce, before the
  residual add) goes through a norm, `post_layernorm` (Megatron-Bridge's name for Gemma 3).
- ProjectionRMSNorm: q/k RMSNorm over the whole projection (all heads), where megatron-core's
  qk_layernorm normalises each head (attention.py:1281). Each TP rank holds some heads, so the sum
  of squares is all-reduced over TP.
- LayerRopeSelfAttention: SelfAttention whose layer may use its own RoPE base (GPTModel has one
  rotary embedding for every layer, gpt_model.py:160). Where the model's RoPE is YaRN (OLMo 3's
  full-attention layers), a layer with a plain RoPE of its own takes no YaRN attention factor, which
  megatron-core applies in every layer from the config (attention.py: 0.16.1 computes it in forward,
  0.19 caches it at init as _yarn_concentration_factor).
- Llama 4's q/k L2 norm (use_qk_norm): megatron-core's own weightless L2Norm (transformer/torch_norm.py, in
  0.16.1 as in 0.19) per head, on the layers with RoPE only (HF builds Llama4TextL2Norm where use_rope): the
  block spec gives a NoPE layer (megatron-core's no_rope_freq) IdentityOp there instead.
- Qwen3-Next's linear-attention layers: megatron-core's own GatedDeltaNet (ssm/gated_delta_net.py, its
  `fla` kernels stood in by toolkit/blocks/kernels/gated_delta_rule.py where missing), with the input norm as
  a layer of its own (the TE spec fuses it into in_proj, hence the checkpoint name) and its output norm
  a plain w, never (1 + w): HF's Qwen3NextRMSNormGated, unlike the model's other norms (GatedRMSNorm).
"""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention

from toolkit.families.spec import ModelSpec
from toolkit.families.table import CustomLayer


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones
        # where megatron-core's own layers put their parameters (tensor_parallel/layers.py)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float() if self.zero_centered else w.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale(self.weight)).type_as(x)


class GatedRMSNorm(RMSNorm):
    """The gated delta net's output norm, built by GatedDeltaNet with the model's config
    (gated_delta_net.py:203-208): weight w whatever layernorm_zero_centered_gamma says, as HF's
    Qwen3NextRMSNormGated (its gate, silu(z), is applied by GatedDeltaNet._apply_gated_norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(config, hidden_size, eps)
        self.zero_centered = False
        with torch.no_grad():
            self.weight.fill_(1.0)


class ProjectionRMSNorm(RMSNorm):
    """Built by SelfAttention with hidden_size = head_dim; `heads` names the whole projection's
    head count. Input: this rank's heads [s, b, n, d]. With fewer KV heads than TP ranks, several
    ranks hold the same key head (attention.py:1398): `replicas` of each term in the TP sum."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, heads: int = 1, **unused):
        super().__init__(config, hidden_size * heads, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        full, local = self.weight.numel(), x.shape[-2] * x.shape[-1]
        replicas = max(1, tp * local // full)
        xf = x.float().flatten(-2)
        sum_sq = xf.pow(2).sum(-1, keepdim=True)
        if tp > 1:
            # all-reduce in forward and in backward: every rank's loss depends on every rank's q
            from torch.distributed.nn.functional import all_reduce

            sum_sq = all_reduce(sum_sq, group=ps.get_tensor_model_parallel_group()) / replicas
        normed = xf * torch.rsqrt(sum_sq / full + self.eps)
        start = (rank // replicas) * local
        return (normed * self.scale(self.weight[start : start + local])).type_as(x).view_as(x)


class PostNormRowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = RMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_):
        return self.post_layernorm(self.forward_before_norm(input_)), None

    def forward_before_norm(self, input_):
        """The linear alone: where an adapter (toolkit/lora) adds its delta, as HF PEFT does on o_proj."""
        output, bias = super().forward(input_)
        assert bias is None, "a post-norm linear has no bias (add_bias_linear=False)"
        return output


class LayerRopeSelfAttention(SelfAttention):
    """`rope_bases[i]`: the RoPE base of global layer i (0-based), None for the model's."""

    def __init__(self, config, submodules, layer_number: int, rope_bases: tuple = (), **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        base = rope_bases[layer_number - 1] if rope_bases else None
        self.layer_rope = None
        if base is not None:
            self.layer_rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=base,
                                              use_cpu_initialization=config.use_cpu_initialization)
            if hasattr(config, "yarn_rotary_scaling_factor"):  # the model's RoPE is YaRN: not this layer's
                self.config = without_yarn(config)
                if hasattr(self, "_yarn_concentration_factor"):
                    self._yarn_concentration_factor = 1.0

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if self.layer_rope is not None and rotary_pos_emb is not None:
            # Under context parallelism the model's embedding holds this rank's chunks only (s / CP
            # rows); the layer's own is asked for the whole sequence and cuts the same chunks itself.
            group = self.layer_rope.cp_group
            rotary_pos_emb = self.layer_rope(rotary_pos_emb.shape[0] * (group.size() if group is not None else 1))
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


class ValueNorm(torch.nn.Module):
    """Gemma 4's v_norm: RMSNorm without a weight over each value head, in fp32 (Gemma4RMSNorm(with_scale=False))."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class KeyIsValueLinear(ColumnParallelLinear):
    """linear_qkv of a Gemma 4 global layer with attention_k_eq_v: it holds [q heads; k] per query group
    (Split.GLOBAL_QK) and returns [q heads; k; k], the layout SelfAttention splits into q, k, v, so the
    values are the keys as projected (before k_norm and RoPE), as HF's. Each TP rank holds whole groups."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        self.key_size = config.kv_channels
        tp = ps.get_tensor_model_parallel_world_size()
        if config.num_query_groups % tp:
            raise NotImplementedError(f"attention_k_eq_v with {config.num_query_groups} global key/value heads at TP {tp}")
        self.local_groups = config.num_query_groups // tp
        super().__init__(input_size, output_size - config.kv_channels * config.num_query_groups, config=config, **kwargs)

    keys_as_values = True  # what a LoRA wrapper (toolkit/lora/layers.py) adds its delta before repeat_keys for

    def forward_qk(self, input_, *args, **kwargs):
        """[q heads; k] per group, as stored."""
        return super().forward(input_, *args, **kwargs)

    def repeat_keys(self, output):
        grouped = output.view(*output.shape[:-1], self.local_groups, -1)
        return torch.cat([grouped, grouped[..., -self.key_size:]], dim=-1).flatten(-2)

    def forward(self, input_, *args, **kwargs):
        output, bias = self.forward_qk(input_, *args, **kwargs)
        return self.repeat_keys(output), bias


def proportional_inv_freq(head_dim: int, base: float, partial: float, device=None) -> torch.Tensor:
    """Gemma 4's global-layer RoPE frequencies (transformers' "proportional" rope type): for the first
    int(partial * head_dim / 2) pairs base ** (-2i / head_dim), the exponent over the whole head; 0 for
    the rest, whose dimensions then pass through (cos 1, sin 0)."""
    angles = int(partial * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)])


class Gemma4SelfAttention(SelfAttention):
    """A Gemma 4 layer's attention. `layer_kinds`: ModelSpec.linear_layers ("2": a global layer), `global_attention`:
    ModelSpec.global_attention, `sliding_theta`: the sliding layers' RoPE base. A global layer is built from a
    copy of the config with its own head size and KV heads (kv_channels, num_query_groups), k as v where
    k_eq_v; every layer has its own RoPE (the model's is asked for its length only) and a value norm."""

    def __init__(self, config, submodules, layer_number: int, layer_kinds: str = "", global_attention=None,
                 sliding_theta: float = 10000.0, **kwargs):
        import copy
        from dataclasses import replace

        from toolkit.families.table import GLOBAL_LAYER

        g = global_attention
        is_global = layer_kinds[layer_number - 1] == GLOBAL_LAYER
        if is_global:
            config = copy.copy(config)
            config.kv_channels, config.num_query_groups = g["head_dim"], g["kv_heads"]
            if g["k_eq_v"]:
                submodules = replace(submodules, linear_qkv=KeyIsValueLinear)
        super().__init__(config, submodules, layer_number, **kwargs)
        self.value_norm = ValueNorm(config.layernorm_epsilon)
        self.layer_rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                          rotary_base=g["rope_theta"] if is_global else sliding_theta,
                                          use_cpu_initialization=config.use_cpu_initialization)
        if is_global:
            inv = self.layer_rope.inv_freq
            self.layer_rope.inv_freq = proportional_inv_freq(config.kv_channels, g["rope_theta"],
                                                             g["partial_rotary_factor"], inv.device).to(inv.dtype)

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            group = self.layer_rope.cp_group
            rotary_pos_emb = self.layer_rope(rotary_pos_emb.shape[0] * (group.size() if group is not None else 1))
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        return (out[0], out[1], self.value_norm(out[2]), *out[3:])


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


def _gemma4_moe_classes():
    """Gemma 4's MoE block (enable_moe_block) as megatron-core's MoE layer with what HF adds around it."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    class Gemma4Router(TopKRouter):
        """Gemma4TextRouter: logits of rms(x) * scale / sqrt(hidden) (x the layer's FFN input, before any norm:
        `routed_input`, set by the MoE layer), softmax top-k renormalised (megatron-core's top-k then softmax),
        then each chosen weight times its expert's per_expert_scale."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype, device=device))
            self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype,
                                                                  device=device))
            for param in (self.scale, self.per_expert_scale):  # summed over TP as the router's weight (router.py:82)
                param.sequence_parallel = config.sequence_parallel
            self.unit_norm = ValueNorm(config.layernorm_epsilon)
            self.root = config.hidden_size ** -0.5
            self.routed_input = None

        def gating(self, input):
            x = self.routed_input if self.routed_input is not None else input
            return super().gating(self.unit_norm(x) * self.scale * self.root)

        def routing(self, logits, *args, **kwargs):
            probs, routing_map = super().routing(logits, *args, **kwargs)
            return probs * self.per_expert_scale.to(probs.dtype), routing_map

    class Gemma4MoELayer(MoELayer):
        """Gemma4TextDecoderLayer's feed-forward half with enable_moe_block, on the layer's residual stream x
        (its pre-MLP norm the identity): post_norm(dense_post_norm(dense(dense_norm(x))) +
        experts_post_norm(experts(experts_norm(x)))), the router reading x itself."""

        def __init__(self, config, submodules=None, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            dense = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                   linear_fc2=RowParallelLinear))
            self.dense = build_module(dense, config=config)
            eps = config.layernorm_epsilon
            self.dense_norm, self.dense_post_norm = RMSNorm(config, config.hidden_size, eps), RMSNorm(config, config.hidden_size, eps)
            self.experts_norm, self.experts_post_norm = (RMSNorm(config, config.hidden_size, eps),
                                                         RMSNorm(config, config.hidden_size, eps))
            self.post_norm = RMSNorm(config, config.hidden_size, eps)

        def forward(self, hidden_states, *args, **kwargs):
            dense, _ = self.dense(self.dense_norm(hidden_states))
            self.router.routed_input = hidden_states
            try:
                experts, bias = super().forward(self.experts_norm(hidden_states), *args, **kwargs)
            finally:
                self.router.routed_input = None
            return self.post_norm(self.dense_post_norm(dense) + self.experts_post_norm(experts)), bias

    return Gemma4Router, Gemma4MoELayer


_GEMMA4_MOE = None


def gemma4_moe_spec(config):
    """megatron-core's local MoE spec with Gemma 4's layer and router (a partial from 0.17, a ModuleSpec before)."""
    from dataclasses import replace

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    global _GEMMA4_MOE
    _GEMMA4_MOE = _GEMMA4_MOE or _gemma4_moe_classes()
    router, layer = _GEMMA4_MOE
    base = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if isinstance(base, ModuleSpec):
        return ModuleSpec(module=layer, submodules=replace(base.submodules, router=router), params=base.params)
    return functools.partial(layer, *base.args, **{**base.keywords, "submodules": replace(base.keywords["submodules"],
                                                                                          router=router)})


def without_yarn(config):
    """A copy of `config` without the yarn_* attributes GPTModel's YaRN reads (toolkit/megatron_settings.py
    config_attributes), so that megatron-core's _yarn_get_concentration_factor_from_config gives 1."""
    import copy

    plain = copy.copy(config)
    for name in [n for n in vars(plain) if n.startswith("yarn_")]:
        delattr(plain, name)
    return plain


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


def gated_delta_net_spec():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from toolkit.runtime import cpu_compat

    cpu_compat.stand_in_gated_delta_rule()  # where `fla` is missing (a no-op where it is there)
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear))


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
    ) if not linear else gated_delta_net_spec()
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
          if getattr(attention.submodules, name, IdentityOp) is not IdentityOp}
    attention = replace(attention, submodules=replace(attention.submodules, **qk))
    return replace(layer, submodules=replace(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm,
                                             self_attention=attention))


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
