"""OLMo-Hybrid (OlmoHybridForCausalLM, allenai/Olmo-Hybrid-7B): gated delta net layers (Qwen3-Next's token
mixer, toolkit/families/qwen3_next.py) with OLMo 3's attention layers (toolkit/families/olmo3.py) every
4th by OlmoHybridConfig's default (layer_types), read through transformers 5.17-5.24's OlmoHybridConfig.
What differs from each, and where megatron-core expresses it (0.19.2 files; 0.16.1 ssm/gated_delta_net.py
where it differs):

  HF (modeling_olmo_hybrid.py)            megatron-core / the toolkit
  layer_types linear / full_attention     linear_attention_freq as a list (Qwen3-Next's read; any other
                                          type refused, naming layer_types[i])
  linear layers: Llama's pre-norms        the toolkit's block spec builds them with CustomLayer.linear_layer
  (attention_layer_norm before the mixer, (toolkit/blocks/decoder_spec.py): RMSNorm input_layernorm /
  feedforward_layer_norm before the MLP,  pre_mlp_layernorm, stored as in_proj.layer_norm_weight and
  as published: transformers' conversion  mlp.linear_fc1.layer_norm_weight (the TE names); no post-norms
  mapping renames them on load)
  attention layers: OLMo 3's post-norms   OLMo 2's rows: PostNormRowParallelLinear (post_attention_layernorm,
  and q/k RMSNorm over the whole q / k    post_feedforward_layernorm), ProjectionRMSNorm for q_norm / k_norm
  projection, no sliding window           (toolkit/blocks/norms.py); no window: Olmo3Attention's is deleted
  linear_attn.q/k/v/g/b/a_proj, six       GatedDeltaNet.in_proj [q; k; v; z; beta; alpha] (gdn.py:40-54,
  Linears (g: the output gate z, b: beta, :172; 0.16.1 :309), concatenated: Split.GDN_IN_PROJ_EACH
  a: the decay's input)                   (toolkit/splits/gated_delta.py)
  linear_attn.q/k/v_conv1d as published   GatedDeltaNet.conv1d over [q; k; v] channels (common.py:223-232,
  (concatenated into conv1d on load,      gdn.py:175-223; 0.16.1 :166-174), silu after: Split.GDN_CONV_EACH
  conversion_mapping.py), no bias
  k heads serving v_heads / k_heads       repeat_interleave of q and k (common.py:418-421; 0.16.1 :351-353),
  value heads each                        as HF's torch_chunk_gated_delta_rule (5.24) / the mixer (5.17)
  g = -exp(A_log) softplus(a + dt_bias)   _compute_g_and_beta (common.py:433-446; 0.16.1 :365), as HF
  beta = sigmoid(b), times 2 where        ScaledBetaGatedDeltaNet, beta_scale 2 (toolkit/blocks/
  linear_allow_neg_eigval (the default)   mixer_gated_delta_net.py; megatron_versions.gdn_beta_in_method)
  l2norm of q and k, the gated delta rule `fla`'s kernels (use_qk_l2norm, common.py:410-411; 0.16.1 :349-350),
                                          toolkit/blocks/kernels/gated_delta_rule.py where `fla` is missing
  o_norm: Qwen3NextRMSNormGated w with    GatedDeltaNet.out_norm times silu(z) (common.py:256-261, :370-380;
  eps 1e-5 whatever rms_norm_eps says     0.16.1 :202-208, :412-421): GatedRMSNorm with fixed_eps 1e-5
  (FLA's FusedRMSNormGated default)       (out_norm_eps); megatron-core would pass layernorm_epsilon
  o_proj                                  GatedDeltaNet.out_proj
  RoPE on the attention layers only,      GPTModel's RoPE (linear layers never rotate in either), and where
  none anywhere where rope_parameters     rope_parameters.rope_theta is null (as published) no RoPE:
  has no rope_theta (OlmoHybridModel)     position_embedding_type 'none' (gpt_model.py:105-107; 0.16.1 :99-101)
  cos / sin kept in fp32                  megatron-core's RoPE in fp32 too; the same in fp32 checkpoints
  every other norm: w, rms_norm_eps       RMSNorm (toolkit/blocks/norms.py), layernorm_epsilon

Not carried over: Qwen3-Next's (1 + w) norms (every norm here is w), its attention output gate (q_proj here is
heads x head_dim), partial rotary, MoE (a dense SwiGLU on every layer), rms_norm_eps on the gated norm; OLMo 3's
sliding windows, its per-layer-type RoPE.

Refused in one line: attention_bias, a rope type other than default, a hidden_act other than silu, a
layer type other than linear_attention / full_attention, value heads not a multiple of key heads.

Names: the checkpoint as published (transformers' convert_olmo_hybrid_weights_to_hf.py writes
attention_layer_norm, feedforward_layer_norm and the three convs on the linear layers,
post_attention_layernorm on the attention layers), which transformers reads through its conversion
mapping. transformers' own save_pretrained of the model writes another form (its attention layers'
post_attention_layernorm as feedforward_layer_norm, the convs cut in three equal chunks): not read here.

HF's gated delta net zeroes padded positions first (apply_mask_to_padding_states); megatron-core's
ignores the attention mask, as for Qwen3-Next: equal for unpadded and right-padded sequences."""

from dataclasses import replace

from toolkit.families import qwen3_next
from toolkit.families.llama import L, M
from toolkit.families.olmo2 import OLMO2
from toolkit.families.qwen3_next import A, G
from toolkit.families.table import FULL_ATTENTION, LINEAR_ATTENTION, CustomLayer, Family, row
from toolkit.splits import Split

# OlmoHybridGatedDeltaNet's output norm: OlmoHybridRMSNormGated(head_v_dim, eps=1e-5), "FLA's
# FusedRMSNormGated uses eps=1e-5 by default" (modeling_olmo_hybrid.py), not rms_norm_eps
GATED_NORM_EPS = 1e-5
# linear_allow_neg_eigval: "the beta parameter is scaled by 2.0 to allow values in range [0, 2]" (OlmoHybridConfig)
NEGATIVE_EIGENVALUE_BETA_SCALE = 2.0

MLP = (M + "mlp.linear_fc1.weight", M + "mlp.linear_fc2.weight")
EVERY_LAYER_ROWS = tuple(r for r in OLMO2.rows if not r.per_layer or r.megatron in MLP)
ATTENTION_ROWS = tuple(replace(r, attention=FULL_ATTENTION) for r in OLMO2.rows if r not in EVERY_LAYER_ROWS)
_QWEN3_NEXT_LINEAR = {r.megatron: r for r in qwen3_next.LINEAR_ROWS}
LINEAR_ROWS = tuple(replace(r, attention=LINEAR_ATTENTION) for r in (
    row(G + "in_proj.layer_norm_weight", L + "attention_layer_norm.weight", Split.REPLICATED, ("hidden",)),
    row(G + "in_proj.weight", tuple(A + f"{p}_proj.weight" for p in "qkvgba"), Split.GDN_IN_PROJ_EACH,
        ("gdn_k_size", "hidden"), ("gdn_k_size", "hidden"), ("gdn_v_size", "hidden"), ("gdn_v_size", "hidden"),
        ("gdn_v_heads", "hidden"), ("gdn_v_heads", "hidden")),
    row(G + "conv1d.weight", tuple(A + f"{p}_conv1d.weight" for p in "qkv"), Split.GDN_CONV_EACH,
        ("gdn_k_size", "one", "gdn_kernel"), ("gdn_k_size", "one", "gdn_kernel"), ("gdn_v_size", "one", "gdn_kernel")),
    _QWEN3_NEXT_LINEAR[G + "dt_bias"],
    _QWEN3_NEXT_LINEAR[G + "A_log"],
    replace(_QWEN3_NEXT_LINEAR[G + "out_norm.weight"], hf=(A + "o_norm.weight",)),
    replace(_QWEN3_NEXT_LINEAR[G + "out_proj.weight"], hf=(A + "o_proj.weight",)),
    row(M + "mlp.linear_fc1.layer_norm_weight", L + "feedforward_layer_norm.weight", Split.REPLICATED, ("hidden",)),
))


def read(cfg: dict) -> dict:
    """Qwen3-Next's hybrid layout and gated delta net sizes, with OLMo-Hybrid's beta scale and output-norm epsilon."""
    fields = qwen3_next.read(cfg, "olmo_hybrid")
    scale = NEGATIVE_EIGENVALUE_BETA_SCALE if cfg.get("linear_allow_neg_eigval") else 1.0
    fields["linear_attention"] = {**fields["linear_attention"], "beta_scale": scale, "out_norm_eps": GATED_NORM_EPS}
    return fields


OLMO_HYBRID = Family(
    name="olmo_hybrid", model_types=("olmo_hybrid",), architecture="OlmoHybridForCausalLM",
    rows=EVERY_LAYER_ROWS + ATTENTION_ROWS + LINEAR_ROWS,
    read=read,  # its qk_norm: megatron-core's qk_layernorm, built as ProjectionRMSNorm by the layer below
    nope_without_theta=True,
    refuse_flags=("attention_bias",),
    mtp_prefix="mtp.",  # OlmoHybridForCausalLM ignores `mtp.*` on load (Qwen3NextPreTrainedModel's rule): left out too
    layer=replace(OLMO2.layer, linear_layer=CustomLayer(pre_norms=True, post_norms=False)),
)
