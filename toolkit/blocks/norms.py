"""Norms megatron-core's local spec lacks, as modules its specs can build.

- RMSNorm: computed in fp32 as HF's Gemma 3 and OLMo 2 norms are, with the weight applied as
  (1 + w) where the config says layernorm_zero_centered_gamma (Megatron-LM's --apply-layernorm-1p,
  which Transformer Engine's norms honour and the local spec's WrappedTorchNorm refuses,
  transformer/torch_norm.py:26). The checkpoint keeps HF's w itself, so no rounding of 1 + w.
  It also runs under sequence parallelism, which WrappedTorchNorm refuses (torch_norm.py:32):
  its weight is tagged `sequence_parallel` as megatron-core's own norms tag theirs, so that its
  gradient, partial on each TP rank, is summed over TP (toolkit.train.parallel).
- ConfigEpsRMSNorm: RMSNorm at the config's eps where megatron-core's builder passes none (the Mamba layer).
- LatentRMSNorm: multi-latent attention's q / kv latent norms at HF's eps of their own (1e-6), where
  megatron-core's MLA builds them at layernorm_epsilon.
- GatedRMSNorm: Qwen3-Next's gated delta net output norm, a plain w, never (1 + w): HF's
  Qwen3NextRMSNormGated, unlike the model's other norms.
- ProjectionRMSNorm: q/k RMSNorm over the whole projection (all heads), where megatron-core's
  qk_layernorm normalises each head (attention.py:1281). Each TP rank holds some heads, so the sum
  of squares is all-reduced over TP.
- ValueNorm: Gemma 4's weightless RMSNorm of each value head (and of its router's input).
- ExtendedRMSNorm: megatron-core's Mamba-2 gated norm (ssm/mamba_mixer.py) over the torch one of
  toolkit/blocks/kernels/mamba2_ssd.py, where `mamba_ssm` is missing (toolkit/runtime/cpu_compat.py).

Llama 4's q/k L2 norm is megatron-core's own weightless L2Norm (transformer/torch_norm.py), chosen in
toolkit/blocks/decoder_spec.py.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from toolkit.blocks.kernels.mamba2_ssd import RMSNormGated
from toolkit.families.mla import HF_LATENT_NORM_EPS


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


class ConfigEpsRMSNorm(RMSNorm):
    """RMSNorm whose eps is the config's layernorm_epsilon where its builder passes none: MambaLayer before 0.19
    builds its norm with (config, hidden_size) only (0.16.1 ssm/mamba_layer.py:85, 0.18.0 :98), where TENorm's
    own default is 1e-5 and RMSNorm's above 1e-6; 0.19 passes eps=config.layernorm_epsilon (0.19.2 mamba_layer.py:93-97)."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **unused):
        super().__init__(config, hidden_size, config.layernorm_epsilon if eps is None else eps)


class LatentRMSNorm(RMSNorm):
    """MLA's q_layernorm / kv_layernorm at HF's HF_LATENT_NORM_EPS whatever eps its builder passes: HF's
    DeepseekV3Attention and Mistral4Attention build q_a_layernorm / kv_a_layernorm with the RMSNorm's default
    eps (modeling_deepseek_v3.py:380, :392; modeling_mistral4.py:394, :406), rms_norm_eps being the pre-norms'
    only, where megatron-core's MLASelfAttention passes eps=layernorm_epsilon (0.19.2
    multi_latent_attention.py:619-629). Kimi-K2.5's rms_norm_eps is 1e-5."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **unused):
        super().__init__(config, hidden_size, HF_LATENT_NORM_EPS)


class GatedRMSNorm(RMSNorm):
    """The gated delta net's output norm, built by GatedDeltaNet with the model's config
    (gated_delta_net.py:203-208): weight w whatever layernorm_zero_centered_gamma says, as HF's
    Qwen3NextRMSNormGated (its gate, silu(z), is applied by GatedDeltaNet._apply_gated_norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, fixed_eps: float | None = None, **unused):
        # fixed_eps: the model's own epsilon for this norm where it is not layernorm_epsilon (OLMo-Hybrid's 1e-5)
        super().__init__(config, hidden_size, eps if fixed_eps is None else fixed_eps)
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


class ValueNorm(torch.nn.Module):
    """Gemma 4's v_norm: RMSNorm without a weight over each value head, in fp32 (Gemma4RMSNorm(with_scale=False))."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class ExtendedRMSNorm(RMSNormGated):
    """megatron-core's ExtendedRMSNorm (mamba_mixer.py, in 0.16.1 as in 0.19): mamba_ssm's gated RMSNorm with
    a sharded state dict, its weight split over TP on dim 0. Upstream's subclasses a MagicMock where
    mamba_ssm is missing, so it is this class there."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not hasattr(self, "tp_group"):
            self.tp_group = ps.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])
