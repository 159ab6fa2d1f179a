"""Ministral 3 (Ministral3ForCausalLM, model_type ministral3; published 3B / 8B / 14B inside the vision-language
wrapper Mistral3ForConditionalGeneration, whose language model this is: toolkit/convert/wrapper.py's mistral3 route).
Piece by piece against transformers 5.24's modeling_ministral3.py, it is Mistral's table (toolkit/families/mistral.py:
Llama's tensors, a sliding window where sliding_window says, none as published) with what differs:

  head_dim                          explicit (128 as published, hidden_size / heads need not be it): megatron-core's
                                    kv_channels, as every family reads it
  rope_parameters (yarn)            YaRN (factor 16 over original_max_position_embeddings 16384 as published, beta
                                    fast / slow 32 / 1, mscale = mscale_all_dim = 1: cos and sin unscaled), read as
                                    megatron-core's yarn_* attributes (toolkit/families/yarn.py)
  the query scale                   Ministral3Attention multiplies the query, after RoPE, by
                                    get_llama_4_attn_scale = 1 + llama_4_scaling_beta * ln(1 + floor(position /
                                    original_max_position_embeddings)): exactly 1 on the first
                                    original_max_position_embeddings positions (16384 as published), a per-position
                                    temperature megatron-core has no counterpart of past them. So the model converts
                                    and trains exactly up to that many tokens (ModelSpec.exact_seq_len, as Mistral
                                    4's: toolkit/families/mistral4.py), and `verify` / the recipe refuse longer
                                    sequences in one line

No biases (Ministral3Attention's projections have none; attention_bias is not a field of its config)."""

from dataclasses import replace

from toolkit.families.mistral import MISTRAL
from toolkit.families.mistral4 import llama4_query_scale_bound

MINISTRAL3 = replace(
    MISTRAL,
    name="ministral3",
    model_types=("ministral3",),
    architecture="Ministral3ForCausalLM",
    rope_types=("default", "yarn"),
    read=lambda cfg: {"exact_seq_len": llama4_query_scale_bound(cfg, "Ministral 3")},
)
