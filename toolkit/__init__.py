"""DeepSpeed / megatron-core integration toolkit.

Importing this package is cheap: torch, megatron-core, DeepSpeed and transformers are imported
lazily by the modules that need them, so `toolkit --help` stays fast.
"""

__version__ = "0.1.0"
