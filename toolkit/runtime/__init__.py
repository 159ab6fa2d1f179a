"""Process-level runtime: torch.distributed + megatron-core parallel state, the CPU
compatibility layer for megatron-core, and a launcher that runs a function on N processes."""
