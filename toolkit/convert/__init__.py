"""Checkpoint conversion between Hugging Face and megatron-core (TP x PP) layouts.

    from toolkit.convert import hf_to_megatron, megatron_to_hf, verify
"""

from __future__ import annotations


def hf_to_megatron(*args, **kwargs):
    from toolkit.convert.to_megatron import hf_to_megatron as impl

    return impl(*args, **kwargs)


def megatron_to_hf(*args, **kwargs):
    from toolkit.convert.to_hf import megatron_to_hf as impl

    return impl(*args, **kwargs)


def verify(*args, **kwargs):
    from toolkit.convert.parity import verify as impl

    return impl(*args, **kwargs)


__all__ = ["hf_to_megatron", "megatron_to_hf", "verify"]
