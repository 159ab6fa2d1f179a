"""Process-level runtime: torch.distributed + megatron-core parallel state, the CPU
compatibility layer for megatron-core, and the launchers: one runs a function on N processes
(launch.py), one runs recipes/finetune.py under torchrun (recipe_launch.py)."""
