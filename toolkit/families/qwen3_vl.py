"""Qwen3-VL's language models (qwen3_vl_text, qwen3_vl_moe_text), published only inside the vision-language
wrappers Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration (toolkit/convert/wrapper.py):
transformers 5.24 has no causal-LM class of them alone (Qwen3VLTextModel / Qwen3VLMoeTextModel are the
decoders without the head, `lm_head` lives in the wrapper). Piece by piece against modeling_qwen3_vl.py and
modeling_qwen3_vl_moe.py, the text model is Qwen3's (toolkit/families/qwen3.py) or Qwen3-MoE's
(toolkit/families/qwen3_moe.py), with what differs:

  the rotary embedding (MRoPE)      Qwen3VLTextRotaryEmbedding computes cos/sin of position * inv_freq per
                                    stream (T, H, W) and copies the H and W streams' values into T's at the
                                    interleaved indices 1, 4, .. and 2, 5, .. below 3 x mrope_section[1 / 2]
                                    (recomposition_frequencies; mrope_interleaved is never read). For text
                                    the three streams hold the same positions (Qwen3VLModel.
                                    compute_3d_position_ids without images: none, then arange in
                                    Qwen3VLTextModel), so the copy writes the values already there: plain
                                    rotate-half RoPE bit for bit, whatever mrope_section is
                                    (tests/test_family_qwen3_vl.py)
  DeepStack                         visual features added to the first layers' hidden states at the image
                                    tokens only (Qwen3VLTextModel._deepstack_process, with
                                    deepstack_visual_embeds None without pixel values): text is the plain LM
  mlp.gate (qwen3_vl_moe)           Qwen3VLMoeTextTopKRouter: softmax over every expert, top-k, always
                                    renormalised (the config class has no norm_topk_prob); mlp_only_layers
                                    and decoder_sparse_step as Qwen3-MoE's
  mlp.experts.gate_up_proj,         fused in the files as published and as transformers saves them (its
  down_proj (qwen3_vl_moe)          qwen3_vl_moe conversion mapping transposes them on load and back on save):
                                    gate_up [E, hidden, 2 x ffn] for x @ W, gate = [..., :ffn], up the rest;
                                    down [E, ffn, hidden]. Read per expert (FusedExperts layout
                                    FUSED_HALVES_X_AT_W with either_orientation, toolkit/convert/fused_experts.py) and written back fused
                                    in that layout, so the wrapper round-trips byte for byte
  q_norm / k_norm, norms, head      Qwen3's: per-head RMSNorms before RoPE, tied head where the wrapper's
                                    tie_word_embeddings says (Qwen3VLConfig, top level; its save writes the
                                    text_config's too)

attention_bias is refused as for Qwen3 (Qwen3VLTextAttention would add biases megatron-core's table here lacks)."""

from dataclasses import replace

from toolkit.families.qwen3 import QWEN3
from toolkit.families.qwen3_moe import QWEN3_MOE
from toolkit.families.router import Router, qwen_moe_layers
from toolkit.families.table import FUSED_HALVES_X_AT_W, FusedExperts

QWEN3_VL = replace(QWEN3, name="qwen3_vl", model_types=("qwen3_vl_text",), architecture="Qwen3VLTextModel")

QWEN3_VL_MOE = replace(
    QWEN3_MOE,
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe_text",),
    architecture="Qwen3VLMoeTextModel",
    router=Router(experts_keys=("num_experts", "num_local_experts"), ffn_key="moe_intermediate_size",
                  layers=qwen_moe_layers),  # renormalise_key None: always renormalised
    fused_experts=FusedExperts(prefix="model.layers.*.mlp.experts.", per_expert="model.layers.*.mlp.experts.#.",
                               gate_up="gate_up_proj", down="down_proj", layout=FUSED_HALVES_X_AT_W,
                               either_orientation=True),
)
