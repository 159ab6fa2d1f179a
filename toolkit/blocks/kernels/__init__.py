"""Plain torch for the GPU kernels (CUDA, Triton) megatron-core imports, where a machine lacks them: the same
contract, computed for exactness rather than speed. toolkit/runtime/cpu_compat.py installs them.

    gated_delta_rule.py   flash-linear-attention's (`fla`) gated delta rule, l2norm and causal conv1d
    mamba2_ssd.py         mamba_ssm's Mamba-2 chunked scan (alone and with the split conv) and gated RMSNorm
"""
