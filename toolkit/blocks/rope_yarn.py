"""megatron-core 0.16.1's YaRN RoPE on a machine without CUDA.

YarnRotaryEmbedding.get_emb moves its inverse frequencies to `torch.cuda.current_device()` whatever
the device (models/common/embeddings/yarn_rotary_pos_embedding.py:120-126), and its constructor calls
it (through _set_cos_sin_cache), so MLASelfAttention with rope_type "yarn" cannot even be built where
torch has no CUDA. There MLASelfAttention is given CpuYarnRotaryEmbedding (toolkit/blocks/attention_mla.py
buildable_mla): megatron-core's class and its helper functions, with get_emb keeping the frequencies
where they are. With CUDA, megatron-core's class is used unchanged.

`without_yarn`: the config a layer with a plain RoPE of its own reads in a YaRN model (OLMo 3's
sliding-window layers, toolkit/blocks/attention_self.py), so that it takes no YaRN attention factor.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn


class CpuYarnRotaryEmbedding(yarn.YarnRotaryEmbedding):
    """YarnRotaryEmbedding whose get_emb runs on the frequencies' own device."""

    def get_emb(self, max_seq_len: int, offset: int = 0):
        assert not self.rotary_interleaved, "Yarn RoPE does not support interleaved rotary embeddings"
        low, high = yarn._yarn_find_correction_range(self.beta_fast, self.beta_slow, self.dim, self.rotary_base,
                                                     self.original_max_position_embeddings,
                                                     self.correction_range_round_to_int)
        device = self.inv_freq_extra.device
        extrapolated = 1.0 - yarn._yarn_linear_ramp_mask(low, high, self.dim // 2, device=device).to(torch.float32)
        inv_freq = self.inv_freq_inter * (1 - extrapolated) + self.inv_freq_extra * extrapolated
        positions = torch.arange(max_seq_len, device=device, dtype=self.inv_freq_extra.dtype) + offset
        emb = torch.cat((torch.outer(positions, inv_freq),) * 2, dim=-1)[:, None, None, :]
        return emb, yarn._yarn_get_concentration_factor(self.scaling_factor, self.mscale, self.mscale_all_dim)


def without_yarn(config):
    """A copy of `config` without the yarn_* attributes GPTModel's YaRN reads (toolkit/megatron_settings.py
    config_attributes), so that megatron-core's _yarn_get_concentration_factor_from_config gives 1."""
    import copy

    plain = copy.copy(config)
    for name in [n for n in vars(plain) if n.startswith("yarn_")]:
        delattr(plain, name)
    return plain
