"""Plain torch stand-ins for GPU kernels megatron-core imports (CUDA or Triton), for machines without them."""
