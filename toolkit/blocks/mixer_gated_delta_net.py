"""Token mixers in place of self-attention: Qwen3-Next's, Qwen3.5's and OLMo-Hybrid's linear-attention layers,
megatron-core's own GatedDeltaNet (ssm/gated_delta_net.py), its `fla` kernels stood in by
toolkit/blocks/kernels/gated_delta_rule.py where missing, with the input norm as a layer of its own
(the TE spec fuses it into in_proj, hence the checkpoint name) and its output norm a plain w
(toolkit/blocks/norms.py GatedRMSNorm).

OLMo-Hybrid's two departures (toolkit/families/olmo_hybrid.py), from ModelSpec.linear_attention:
- `beta_scale` 2 (linear_allow_neg_eigval: beta = 2 sigmoid(b), modeling_olmo_hybrid.py
  OlmoHybridGatedDeltaNet.forward): ScaledBetaGatedDeltaNet, where megatron-core computes beta
  (megatron_versions.gdn_beta_in_method says how the installed release lets it in);
- `out_norm_eps`, the output norm's epsilon where it is not the model's rms_norm_eps (OLMo-Hybrid's
  OlmoHybridRMSNormGated(eps=1e-5) whatever the config says): GatedRMSNorm's fixed_eps.
"""

from __future__ import annotations

import contextvars
import functools

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.norms import GatedRMSNorm

# The beta scale of the gated delta net running now, where the release computes beta inside forward
_BETA_SCALE = contextvars.ContextVar("toolkit_gdn_beta_scale", default=1.0)


def gated_delta_net_spec(linear_attention: dict | None = None):
    """The self_attention slot of a linear-attention layer: GatedDeltaNet with the norms and linears above
    (`linear_attention`: ModelSpec.linear_attention, for OLMo-Hybrid's beta_scale and out_norm_eps)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from toolkit.runtime import cpu_compat

    cpu_compat.stand_in_gated_delta_rule()  # where `fla` is missing (a no-op where it is there)
    la = linear_attention or {}
    eps = la.get("out_norm_eps")
    out_norm = GatedRMSNorm if eps is None else ModuleSpec(module=GatedRMSNorm, params={"fixed_eps": eps})
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=out_norm, out_proj=RowParallelLinear)
    scale = la.get("beta_scale", 1.0)
    if scale == 1.0:
        return ModuleSpec(module=GatedDeltaNet, submodules=submodules)
    return ModuleSpec(module=_scaled_beta_class(), params={"beta_scale": scale}, submodules=submodules)


@functools.cache
def _scaled_beta_class():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from toolkit.runtime import megatron_versions

    in_method = megatron_versions.gdn_beta_in_method()
    if not in_method:
        _scale_beta_in_kernels()

    class ScaledBetaGatedDeltaNet(GatedDeltaNet):
        """GatedDeltaNet with beta = beta_scale * sigmoid(b) (OLMo-Hybrid's linear_allow_neg_eigval: 2)."""

        def __init__(self, *args, beta_scale: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.beta_scale = beta_scale

        if in_method:
            def _compute_g_and_beta(self, *args, **kwargs):
                g, beta = super()._compute_g_and_beta(*args, **kwargs)
                return g, beta * self.beta_scale
        else:
            def forward(self, *args, **kwargs):
                token = _BETA_SCALE.set(self.beta_scale)
                try:
                    return super().forward(*args, **kwargs)
                finally:
                    _BETA_SCALE.reset(token)

    return ScaledBetaGatedDeltaNet


def _scale_beta_in_kernels() -> None:
    """Where GatedDeltaNet.forward computes beta itself and calls its module's kernels by name (0.16.1:
    gated_delta_net.py:366-390), those names take the running layer's beta scale (1 for every other model)."""
    import importlib

    from toolkit.runtime import megatron_versions

    module = importlib.import_module(megatron_versions.gated_delta_net_modules()[0])
    for name in ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"):
        kernel = getattr(module, name)
        if not getattr(kernel, "_toolkit_beta_scaled", False):
            setattr(module, name, _beta_scaled(kernel))


def _beta_scaled(kernel):
    @functools.wraps(kernel)
    def run(*args, beta, **kwargs):
        scale = _BETA_SCALE.get()
        return kernel(*args, beta=beta if scale == 1.0 else beta * scale, **kwargs)

    run._toolkit_beta_scaled = True
    return run
