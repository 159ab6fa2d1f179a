"""megatron-core SelfAttention with the RoPE of its own layer, which GPTModel does not give (it has one
rotary embedding for every layer, gpt_model.py:160).

- LayerRopeSelfAttention: a layer whose RoPE base may be its own (Gemma 3's and OLMo 3's sliding-window
  layers). Where the model's RoPE is YaRN (OLMo 3's full-attention layers), a layer with a plain RoPE of
  its own takes no YaRN attention factor, which megatron-core applies in every layer from the config
  (attention.py: 0.16.1 computes it in forward, 0.19 caches it at init as _yarn_concentration_factor).
- Gemma4SelfAttention: Gemma 4's layers, a global layer with its own head size and KV heads, its keys
  as values where attention_k_eq_v (toolkit/blocks/linears.py KeyIsValueLinear), every layer with its
  own RoPE (the global ones proportional: toolkit/blocks/rope_proportional.py) and a value norm.
"""

from __future__ import annotations

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention

from toolkit.blocks.linears import KeyIsValueLinear
from toolkit.blocks.norms import ValueNorm
from toolkit.blocks.rope_proportional import proportional_inv_freq
from toolkit.blocks.rope_yarn import without_yarn


class LayerRopeSelfAttention(SelfAttention):
    """`rope_bases[i]`: the RoPE base of global layer i (0-based), None for the model's."""

    def __init__(self, config, submodules, layer_number: int, rope_bases: tuple = (), **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        base = rope_bases[layer_number - 1] if rope_bases else None
        self.layer_rope = None
        if base is not None:
            self.layer_rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=base,
                                              use_cpu_initialization=config.use_cpu_initialization)
            if hasattr(config, "yarn_rotary_scaling_factor"):  # the model's RoPE is YaRN: not this layer's
                self.config = without_yarn(config)
                if hasattr(self, "_yarn_concentration_factor"):
                    self._yarn_concentration_factor = 1.0

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if self.layer_rope is not None and rotary_pos_emb is not None:
            # Under context parallelism the model's embedding holds this rank's chunks only (s / CP
            # rows); the layer's own is asked for the whole sequence and cuts the same chunks itself.
            group = self.layer_rope.cp_group
            rotary_pos_emb = self.layer_rope(rotary_pos_emb.shape[0] * (group.size() if group is not None else 1))
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


class Gemma4SelfAttention(SelfAttention):
    """A Gemma 4 layer's attention. `layer_kinds`: ModelSpec.linear_layers ("2": a global layer), `global_attention`:
    ModelSpec.global_attention, `sliding_theta`: the sliding layers' RoPE base. A global layer is built from a
    copy of the config with its own head size and KV heads (kv_channels, num_query_groups), k as v where
    k_eq_v; every layer has its own RoPE (the model's is asked for its length only) and a value norm."""

    def __init__(self, config, submodules, layer_number: int, layer_kinds: str = "", global_attention=None,
                 sliding_theta: float = 10000.0, **kwargs):
        import copy
        from dataclasses import replace

        from toolkit.families.table import GLOBAL_LAYER

        g = global_attention
        is_global = layer_kinds[layer_number - 1] == GLOBAL_LAYER
        if is_global:
            config = copy.copy(config)
            config.kv_channels, config.num_query_groups = g["head_dim"], g["kv_heads"]
            if g["k_eq_v"]:
                submodules = replace(submodules, linear_qkv=KeyIsValueLinear)
        super().__init__(config, submodules, layer_number, **kwargs)
        self.value_norm = ValueNorm(config.layernorm_epsilon)
        self.layer_rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                          rotary_base=g["rope_theta"] if is_global else sliding_theta,
                                          use_cpu_initialization=config.use_cpu_initialization)
        if is_global:
            inv = self.layer_rope.inv_freq
            self.layer_rope.inv_freq = proportional_inv_freq(config.kv_channels, g["rope_theta"],
                                                             g["partial_rotary_factor"], inv.device).to(inv.dtype)

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            group = self.layer_rope.cp_group
            rotary_pos_emb = self.layer_rope(rotary_pos_emb.shape[0] * (group.size() if group is not None else 1))
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        return (out[0], out[1], self.value_norm(out[2]), *out[3:])
