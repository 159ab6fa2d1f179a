"""Token mixers in place of self-attention: Qwen3-Next's (and Qwen3.5's) linear-attention layers,
megatron-core's own GatedDeltaNet (ssm/gated_delta_net.py), its `fla` kernels stood in by
toolkit/blocks/kernels/gated_delta_rule.py where missing, with the input norm as a layer of its own
(the TE spec fuses it into in_proj, hence the checkpoint name) and its output norm a plain w
(toolkit/blocks/norms.py GatedRMSNorm)."""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.norms import GatedRMSNorm


def gated_delta_net_spec():
    """The self_attention slot of a linear-attention layer: GatedDeltaNet with the norms and linears above."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from toolkit.runtime import cpu_compat

    cpu_compat.stand_in_gated_delta_rule()  # where `fla` is missing (a no-op where it is there)
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear))
