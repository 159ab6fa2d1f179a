"""Nemotron-H's Mamba-2 layers: megatron-core's own MambaMixer (ssm/mamba_mixer.py), its `mamba_ssm` kernels
stood in by toolkit/blocks/kernels/mamba2_ssd.py where missing (toolkit/runtime/cpu_compat.py
stand_in_mamba_ssm; its gated norm then toolkit/blocks/norms.py ExtendedRMSNorm), with local linears for
in_proj and out_proj (the TE spec fuses the layer's input norm into in_proj, TELayerNormColumnParallelLinear,
hence its checkpoint name `mixer.in_proj.layer_norm_weight`).

HF's NemotronHMamba2Mixer (transformers 5.24 models/nemotron_h/modeling_nemotron_h.py) against megatron-core
0.19.2's MambaMixer (ssm/mamba_mixer.py; 0.16.1's line where it differs), heads h, head dim p, B/C groups g,
state n, inner = h p; TP t splits heads and groups alike (:260, :268: both must divide by t):

  in_proj.weight [inner + inner + 2 g n + h,   in_proj.weight, the same rows [z; x; B; C; dt] (HF splits
  hidden] (:429, split :515 into gate,         gate / hidden_states_B_C / dt at :515 and x / B / C at :551;
  hidden_states_B_C, dt)                       megatron-core z / xBC / dt at :847): each of the five parts
                                               over TP on its own (in_proj_partition_sizes :298; torch_dist
                                               keys in_proj.weight.<z|x|B|C|dt>, :1418), Split.MAMBA_IN_PROJ
  conv1d.weight [inner + 2 g n, 1, kernel],    conv1d_weight / conv1d_bias (:321; 0.16.1 an nn.Conv1d
  conv1d.bias (:419, depthwise, silu after)    `conv1d`, :296; torch_dist keys conv1d.weight / conv1d.bias
                                               on both, :1370): parts [x; B; C] each over TP (:1476),
                                               Split.MAMBA_CONV; megatron_versions.mamba_conv_names()
  A_log [h] (:441; A = -exp(A_log) :488)       A_log [h/t] (:395; the same A, :742), Split.COLUMN
  D [h] (:445)                                 D [h/t] (:407, D_has_hdim False), Split.COLUMN
  dt_bias [h] (:437)                           dt_bias [h/t] (:383), Split.COLUMN; softplus(dt + dt_bias)
                                               in both. HF then clamps dt below at time_step_min (:415:
                                               time_step_limit = (time_step_min, inf)); megatron-core
                                               passes no dt_limit (:755, mamba_ssm's default (0, inf)):
                                               equal wherever softplus(dt + dt_bias) >= time_step_min, not
                                               below it (tests/test_mamba2_ssd.py shows the gap)
  norm.weight [inner] (NemotronHRMSNormGated   norm.weight [inner/t] (ExtendedRMSNorm :417, eps fixed at
  :56: y * silu(z), then RMS per group of      1e-5 :419, group_size inner/g, norm_before_gate False
  inner / g, then w; eps layer_norm_epsilon)   asserted :276), Split.COLUMN: y * silu(z) in the scan on the
                                               training path, the norm without z after (:779); the prefill
                                               path passes z to the norm (:1093)
  out_proj.weight [hidden, inner] (:448)       out_proj.weight, RowParallelLinear, Split.ROW
  in_proj / out_proj bias (use_bias)           none: MambaMixer asserts bias False (:274) and conv_bias True
                                               (:275); a config with use_bias or without use_conv_bias is refused

HF zeroes padded positions before in_proj and after the conv (apply_mask_to_padding_states :131, called at
:485 and :549); MambaLayer takes no mask (ssm/mamba_layer.py forward: attention_mask "Not used"): equal for
unpadded and right-padded sequences (causal), not for left padding.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

def mamba_mixer_spec(conv_kernel: int, chunk_size: int):
    """The mixer of a Mamba-2 layer: MambaMixer with the config's conv width and scan chunk (constructor
    arguments, not TransformerConfig fields: MambaLayer passes neither, mamba_layer.py)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from toolkit.runtime import cpu_compat, megatron_versions

    cpu_compat.stand_in_mamba_ssm()  # where `mamba_ssm` is missing (a no-op where it is there)
    mamba_mixer = megatron_versions.mamba_mixer_module()
    return ModuleSpec(module=mamba_mixer.MambaMixer, params={"d_conv": conv_kernel, "chunk_size": chunk_size},
                      submodules=mamba_mixer.MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                  out_proj=RowParallelLinear))
