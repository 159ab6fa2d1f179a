"""Plain torch for the GPU kernels (CUDA, Triton) megatron-core imports, where a machine lacks them: the same
contract, computed for exactness rather than speed. toolkit/runtime/cpu_compat.py installs them.

    gated_delta_rule.py   flash-linear-attention's (`fla`) gated delta rule, l2norm and causal conv1d
"""
