"""The pieces a model is built from: megatron-core modules the toolkit adds or adapts (see the modules)."""
