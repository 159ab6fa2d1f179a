"""YaRN RoPE (rope_type 'yarn') read from config.json as HF computes it, as the `yarn_*` attributes
megatron-core's GPTModel reads from its config (gpt_model.py:172-190, position_embedding_type='yarn').

HF (modeling_rope_utils.py _compute_yarn_parameters) and megatron-core (yarn_rotary_pos_embedding.py
YarnRotaryEmbedding.get_emb) compute the same inverse frequencies step for step: base ** (2i / d),
1 / (factor * that) for the interpolated ones, the correction range of beta_fast / beta_slow over
original_max_position_embeddings (rounded to whole dimensions where HF's `truncate`, default true:
megatron-core's correction_range_round_to_int), and the same linear ramp between them. Both multiply
cos and sin by one attention factor: HF's get_mscale(factor, mscale) / get_mscale(factor,
mscale_all_dim) where both are set, else get_mscale(factor); megatron-core's attention applies
_yarn_get_concentration_factor_from_config (attention.py:1102), the ratio where both are given, else
get_mscale(factor) (yarn_rotary_pos_embedding.py:259-271).
"""

from __future__ import annotations

import math

from toolkit.errors import ConversionError


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _derived_attention_factor(factor: float, mscale, mscale_all_dim, both: bool) -> float:
    """The factor megatron-core applies (yarn_rotary_pos_embedding.py _yarn_get_concentration_factor), as HF
    derives it where config.json gives none: the ratio of the two mscales where both are set, else get_mscale(factor)."""
    if both:
        return float(_get_mscale(factor, float(mscale)) / _get_mscale(factor, float(mscale_all_dim)))
    return _get_mscale(factor)


def read_yarn(cfg: dict, params: dict, source: str) -> dict:
    """megatron-core's yarn_* config attributes for HF's rope_parameters `params`."""
    original = params.get("original_max_position_embeddings")
    if type(original) is not int or original < 1:
        raise ConversionError(f"{source}.original_max_position_embeddings={original!r}: YaRN needs a positive integer")
    factor = params.get("factor")
    factor = float(cfg["max_position_embeddings"] / original if factor is None else factor)  # as HF does
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # HF uses the ratio only where both are set and non-zero
    explicit = params.get("attention_factor")
    # OLMo 3 writes the factor out (1.2079441541679836 = get_mscale(8)): exact where it is the one derived
    if explicit is not None and float(explicit) != _derived_attention_factor(factor, mscale, mscale_all_dim, both):
        raise ConversionError(f"{source}.attention_factor={explicit!r}: an explicit YaRN attention factor other than "
                              f"the one derived from factor, mscale and mscale_all_dim "
                              f"({_derived_attention_factor(factor, mscale, mscale_all_dim, both)!r}) has no "
                              "megatron-core 0.16.1 setting")
    return {
        "yarn_rotary_scaling_factor": factor,
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(params.get("beta_fast") or 32),
        "yarn_beta_slow": float(params.get("beta_slow") or 1),
        "yarn_mscale": float(mscale) if both else None,
        "yarn_mscale_all_dim": float(mscale_all_dim) if both else None,
        "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
    }
