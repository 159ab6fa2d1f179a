"""LongRoPE's parameters read from a config.json (Phi-3.5-mini, Phi-4-mini, the Phi-3 128k
models), as transformers 5.23 reads them; the rotary module that uses them is toolkit/blocks/rope_longrope.py."""

from __future__ import annotations

import math

from toolkit.errors import ConversionError

ORIGINAL_MAX = "original_max_position_embeddings"


def _factors(params: dict, key: str, source: str) -> list[float]:
    value = params.get(key)
    if not isinstance(value, list) or not value or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
        raise ConversionError(f"{source}.{key}={value!r}: LongRoPE needs a list of positive numbers, one per rotated "
                              "frequency")
    return [float(x) for x in value]


def _original_max(cfg: dict, params: dict) -> int:
    """transformers' Phi3Config keeps original_max_position_embeddings at the top level (class
    default 4096) and it overrides the one in rope_parameters (PreTrainedConfig.standardize_rope_params);
    a config class without that attribute takes rope_parameters', else max_position_embeddings."""
    from transformers import CONFIG_MAPPING

    class_default = getattr(CONFIG_MAPPING[cfg["model_type"]], ORIGINAL_MAX, None)
    value = cfg.get(ORIGINAL_MAX, class_default)
    if value is None:
        value = params.get(ORIGINAL_MAX, cfg.get("max_position_embeddings"))
    if type(value) is not int or value < 1:
        raise ConversionError(f"{ORIGINAL_MAX}={value!r}: LongRoPE needs a positive integer")
    return value


def read_longrope(cfg: dict, params: dict, source: str) -> dict:
    """The LongRoPE parameters of a config (`params`: its rope_parameters or rope_scaling dict,
    named `source`), as the ModelSpec field `longrope`."""
    original = _original_max(cfg, params)
    factor = params.get("factor")
    if factor is None:
        factor = cfg["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"short_factor": _factors(params, "short_factor", source), "long_factor": _factors(params, "long_factor", source),
            ORIGINAL_MAX: original, "attention_factor": float(attention)}


def check_factor_counts(longrope: dict, rotary_dim: int) -> None:
    """One factor per rotated frequency (HF multiplies them elementwise with the frequencies)."""
    for key in ("short_factor", "long_factor"):
        if len(longrope[key]) != rotary_dim // 2:
            raise ConversionError(f"LongRoPE {key} has {len(longrope[key])} values but RoPE rotates {rotary_dim} "
                                  f"dimensions of each head: {rotary_dim // 2} frequencies")
