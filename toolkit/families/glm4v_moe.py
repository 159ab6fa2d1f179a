"""GLM-4.5V / GLM-4.6V's language model (glm4v_moe_text), published only inside the vision-language wrappers
Glm4vMoeForConditionalGeneration (glm4v_moe) and Glm46VForConditionalGeneration (glm46v, whose text_config names
glm4v_moe_text for GLM-4.6V) (toolkit/convert/wrapper.py): transformers 5.24 has no causal-LM class of it alone
(Glm4vMoeTextModel is the decoder without the head). Piece by piece against modeling_glm4v_moe.py, it is GLM-4.5's
(toolkit/families/glm4_moe.py) with what differs:

  q_norm / k_norm                   none: Glm4vMoeTextAttention has no q/k norms whatever `use_qk_norm` says (the
                                    published text_config writes it false; the class never reads it), so the
                                    spec never has them
  the rotary embedding (MRoPE)      Glm4vMoeTextRotaryEmbedding computes cos/sin of position * inv_freq per stream
                                    (T, H, W) over int(head_dim * partial_rotary_factor) dimensions and takes
                                    consecutive chunks of mrope_section frequencies from T, H, W in turn
                                    (recomposition_frequencies). For text the three streams hold the same positions
                                    (Glm4vMoeTextModel: arange expanded to 3), so every chunk is T's: plain partial
                                    rotate-half RoPE bit for bit, whatever mrope_section is
                                    (tests/test_family_glm4v_moe.py)
  mlp (Glm4vMoeTextMoE)             GLM-4.5's: sigmoid router in float32 with the expert bias, groups, routed
                                    scaling, renormalised where norm_topk_prob, ungated shared experts, dense
                                    layers below first_k_dense_replace
  mlp.experts                       per expert in GLM-4.5V's files (as published, and as transformers saves them:
                                    its glm4v_moe conversion mapping is qwen2_moe's); fused in GLM-4.6V's as
                                    transformers 5.24 saves and reads Glm46VForConditionalGeneration (it has no
                                    conversion mapping: per-expert tensors are not loaded into it): gate_up_proj
                                    [E, 2 x ffn, hidden] halves, down_proj [E, hidden, ffn] (FUSED_HALVES), read
                                    per expert and written back fused into a glm46v wrapper that holds them so
                                    (Wrapper.experts_as_stored), per expert otherwise
  q/k/v biases, o_proj              biases where attention_bias (true as published), o_proj without: GLM-4.5's

The published files hold no multi-token-prediction layer (46 layers of 46); a text_config naming
num_nextn_predict_layers has them left out as GLM-4.5's are."""

from dataclasses import replace

from toolkit.families.glm4_moe import GLM4_MOE
from toolkit.families.table import FUSED_HALVES, FusedExperts

GLM4V_MOE = replace(
    GLM4_MOE,
    name="glm4v_moe",
    model_types=("glm4v_moe_text",),
    architecture="Glm4vMoeTextModel",
    read=lambda cfg: {"qk_norm": False},
    fused_experts=FusedExperts(prefix="model.layers.*.mlp.experts.", per_expert="model.layers.*.mlp.experts.#.",
                               gate_up="gate_up_proj", down="down_proj", layout=FUSED_HALVES, export_fused=False),
)
