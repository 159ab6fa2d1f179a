"""OLMo 3: OLMo 2's layer (post-norms only, q/k RMSNorms over the whole projection) with sliding-window
layers between full-attention ones (layer_types; by Olmo3Config's default three of every four layers
windowed, every fourth full) and a RoPE per layer type (rope_parameters.sliding_attention /
.full_attention, modeling_olmo3.py Olmo3RotaryEmbedding). As published, YaRN is on the full-attention
layers only: Olmo3Config puts a file's rope_scaling into rope_parameters.full_attention
(convert_rope_params_to_dict), and the sliding layers keep the default RoPE of the same base.

  HF (transformers 5.24)                  megatron-core / the toolkit
  q_norm / k_norm over q_proj / k_proj    ProjectionRMSNorm (toolkit/blocks/norms.py), as OLMo 2
  post_attention / post_feedforward norm  PostNormRowParallelLinear, as OLMo 2
  layer_types, sliding_window             window_size=(sliding_window - 1, 0), window_attn_skip_freq as a list
  rope_parameters.full_attention          GPTModel's RoPE: plain, or YaRN (position_embedding_type='yarn',
                                          the yarn_* config attributes, toolkit/families/yarn.py)
  rope_parameters.sliding_attention       each windowed layer's own plain RoPE (LayerRopeSelfAttention, as
                                          Gemma 3's local base), without YaRN's attention factor
"""

from toolkit.families.gemma3 import LAYER_TYPES, layer_types, local_rope_theta
from toolkit.families.olmo2 import OLMO2
from toolkit.families.table import CustomLayer, Family


def read(cfg: dict) -> dict:
    return {"window_layers": "".join(LAYER_TYPES[t] for t in layer_types(cfg, "olmo3")),
            "window_rope_theta": local_rope_theta(cfg, "olmo3")}


OLMO3 = Family(
    name="olmo3",
    model_types=("olmo3",),
    architecture="Olmo3ForCausalLM",
    rows=OLMO2.rows,
    window_key="sliding_window",
    refuse_flags=("attention_bias",),
    rope_types=("default", "yarn"),
    rope_key="full_attention",
    megatron={"qk_layernorm": True},
    read=read,
    layer=CustomLayer(pre_norms=False, post_norms=True, qk_norm="projection"),
)
