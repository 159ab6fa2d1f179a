"""YaRN RoPE scaling (DeepSeek-V3, Kimi-K2) read from config.json's rope_parameters, refusing what
megatron-core 0.16.1's YarnRotaryEmbedding (models/common/embeddings/yarn_rotary_pos_embedding.py)
computes otherwise than transformers 5.23 (modeling_rope_utils.py `_compute_yarn_parameters`).

Both interpolate the inverse frequencies 1 / theta ** (arange(0, dim, 2) / dim) between themselves
and themselves over `factor` with the same linear ramp between the correction dimensions of
`beta_fast` and `beta_slow` (floored / ceiled: HF's `truncate`, default true, megatron-core's
`correction_range_round_to_int`, always true from MLA), and multiply cos and sin by a factor:
  HF:            get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) where both are set,
                 else get_mscale(factor); `attention_factor` where the config gives one
  megatron-core: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), always
                 (_yarn_get_concentration_factor, yarn_rotary_pos_embedding.py:259-271; get_mscale(s, 0) = 1)
(get_mscale(s, m) = 0.1 m ln s + 1 for s > 1). They agree where both mscales are set, and where
mscale_all_dim is not and mscale is 1 (or unset); the other cases and an explicit attention_factor
are refused. The softmax scale get_mscale(factor, mscale_all_dim)**2 / sqrt(qk head dim) is the same
in both (HF yarn_apply_mscale, megatron-core multi_latent_attention.py:125-126).
"""

from __future__ import annotations

from toolkit.errors import ConversionError

# HF's defaults where rope_parameters leaves them out (`or 32`, `or 1`)
HF_BETA_FAST, HF_BETA_SLOW = 32.0, 1.0


def read_yarn(params: dict, source: str) -> dict:
    """megatron-core's YaRN fields (MLATransformerConfig names) from a resolved rope_parameters."""
    def number(key: str, default=None):
        value = params.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConversionError(f"{source}.{key}={value!r}: expected a number")
        return float(value)

    if params.get("attention_factor") is not None:
        raise ConversionError(f"{source}.attention_factor={params['attention_factor']!r}: an explicit YaRN attention "
                              "factor cannot be mapped exactly to megatron-core 0.16.1, which always derives it from "
                              "mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        raise ConversionError(f"{source}.truncate={params['truncate']!r}: megatron-core 0.16.1's MLA always rounds "
                              "YaRN's correction range to whole dimensions (truncate=true)")
    factor, original = number("factor"), params.get("original_max_position_embeddings")
    if factor is None or type(original) is not int or original < 1:
        raise ConversionError(f"{source} has rope_type 'yarn' without a 'factor' and an integer "
                              "'original_max_position_embeddings'")
    mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")
    if not mscale_all_dim:
        if mscale not in (None, 1.0):
            raise ConversionError(f"{source}.mscale={mscale!r} without mscale_all_dim: HF then scales cos and sin by "
                                  "get_mscale(factor) and ignores mscale, megatron-core 0.16.1 by get_mscale(factor, "
                                  "mscale): set mscale_all_dim, or mscale to 1")
        mscale, mscale_all_dim = 1.0, 0.0
    elif not mscale:
        raise ConversionError(f"{source}.mscale_all_dim={mscale_all_dim!r} without mscale: HF then scales cos and sin "
                              "by get_mscale(factor), megatron-core 0.16.1 by get_mscale(factor) / get_mscale(factor, "
                              "mscale_all_dim): set mscale")
    return {"rotary_scaling_factor": factor, "original_max_position_embeddings": original,
            "beta_fast": number("beta_fast") or HF_BETA_FAST, "beta_slow": number("beta_slow") or HF_BETA_SLOW,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim}
