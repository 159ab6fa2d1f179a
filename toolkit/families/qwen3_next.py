"""Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): gated delta net (linear attention) layers
with output-gated attention layers every `full_attention_interval`-th (layer_types), a sparse MoE with
a sigmoid-gated shared expert (Qwen2-MoE's), RMSNorms applied as (1 + w), partial rotary. Each piece
as megatron-core 0.16.1 expresses it:

  layer_types                       linear_attention_freq as a list (1: gated delta net), the toolkit's
                                    block spec building GatedDeltaNet there (toolkit/blocks/decoder_spec.py); stored
                                    per layer in torch_dist (transformer_block.py:836-840)
  linear_attn.in_proj_qkvz, _ba     GatedDeltaNet.in_proj [q; k; v; z; beta; alpha] (gated_delta_net.py:
                                    140-156, :289-298), re-laid out from HF's per-key-head groups
                                    (Split.GDN_IN_PROJ, toolkit/splits/gated_delta.py)
  linear_attn.conv1d                GatedDeltaNet.conv1d, silu after (:161-174, :326-327); per TP rank its
                                    q, k and v channels (Split.GDN_CONV)
  linear_attn.dt_bias, A_log        GatedDeltaNet.dt_bias, A_log: g = -exp(A_log) softplus(a + dt_bias),
                                    beta = sigmoid(b) (:364-366), as HF
  the gated delta rule              `fla`'s chunk_gated_delta_rule and l2norm on q, k (:349-350, :382),
                                    toolkit/blocks/kernels/gated_delta_rule.py where `fla` is missing
  linear_attn.norm (gated)          GatedDeltaNet.out_norm times silu(z) (:412-421): w, not (1 + w), as
                                    HF's Qwen3NextRMSNormGated (toolkit/blocks/norms.py GatedRMSNorm)
  linear_attn.out_proj              GatedDeltaNet.out_proj
  self_attn.q_proj (2 x heads)      attention_output_gate: linear_qkv holds per query group [q; gate; k; v]
                                    (attention.py:1390-1430), output times sigmoid(gate) (:1218-1224)
                                    (Split.GATED_QKV re-lays HF's per-head [q_h; gate_h] out)
  q_norm, k_norm                    qk_layernorm, per head
  every other RMSNorm (1 + w)       layernorm_zero_centered_gamma (toolkit/blocks/norms.py RMSNorm), HF's w stored
  partial_rotary_factor             rotary_percent
  mlp (router, experts, shared      Qwen2-MoE's rows: softmax top-k renormalised iff norm_topk_prob,
  expert and its gate)              SharedExpertMLP with moe_shared_expert_gate; mlp_only_layers /
                                    decoder_sparse_step as moe_layer_freq

HF's gated delta net zeroes padded positions first (apply_mask_to_padding_states); megatron-core's
ignores the attention mask (gated_delta_net.py:280): equal for unpadded and right-padded sequences
(causal), not for left padding."""

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.experts import ATTENTION_ROWS, DENSE_LAYER_ROWS, GATE_PROJ_EXPERT_ROWS, shared_expert_rows
from toolkit.families.hf_values import positive_ints
from toolkit.families.llama import BY_NAME, L, M
from toolkit.families.qwen2_moe import QWEN2_MOE, S
from toolkit.families.qwen3_moe import QK_NORMS
from toolkit.families.table import FULL_ATTENTION, LINEAR_ATTENTION, CustomLayer, Family, row
from toolkit.splits import Split

A = L + "linear_attn."
G = M + "self_attention."
INPUT_NORM, QKV = M + "self_attention.linear_qkv.layer_norm_weight", M + "self_attention.linear_qkv.weight"
ATTENTION_ONLY = (INPUT_NORM, QKV, M + "self_attention.linear_proj.weight")

FULL_ROWS = tuple(replace(r, attention=FULL_ATTENTION) for r in ATTENTION_ROWS + QK_NORMS
                  if r.megatron in ATTENTION_ONLY + tuple(q.megatron for q in QK_NORMS) and r.megatron != QKV) + (
    row(QKV, (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
        Split.GATED_QKV, ("gated_q_size", "hidden"), ("kv_size", "hidden"), ("kv_size", "hidden"),
        attention=FULL_ATTENTION),
)
LINEAR_ROWS = tuple(replace(r, attention=LINEAR_ATTENTION) for r in (
    replace(BY_NAME[INPUT_NORM], megatron=G + "in_proj.layer_norm_weight"),
    row(G + "in_proj.weight", (A + "in_proj_qkvz.weight", A + "in_proj_ba.weight"), Split.GDN_IN_PROJ,
        ("gdn_qkvz", "hidden"), ("gdn_ba", "hidden")),
    row(G + "conv1d.weight", A + "conv1d.weight", Split.GDN_CONV, ("gdn_conv", "one", "gdn_kernel")),
    row(G + "dt_bias", A + "dt_bias", Split.COLUMN, ("gdn_v_heads",)),
    row(G + "A_log", A + "A_log", Split.COLUMN, ("gdn_v_heads",)),
    row(G + "out_norm.weight", A + "norm.weight", Split.REPLICATED, ("gdn_v_dim",)),
    row(G + "out_proj.weight", A + "out_proj.weight", Split.ROW, ("hidden", "gdn_v_size")),
))
COMMON_ROWS = tuple(r for r in ATTENTION_ROWS if r.megatron not in ATTENTION_ONLY)
LAYER_TYPES = {"linear_attention": "1", "full_attention": "0"}
# ModelSpec.linear_attention's keys and the config.json keys they are read from
LINEAR_KEYS = {"k_heads": "linear_num_key_heads", "v_heads": "linear_num_value_heads", "k_dim": "linear_key_head_dim",
               "v_dim": "linear_value_head_dim", "conv_kernel": "linear_conv_kernel_dim"}


def read(cfg: dict, family: str = "qwen3_next") -> dict:
    """The hybrid layout and the gated delta net's sizes (Qwen3-Next's, and Qwen3.5's: toolkit/families/qwen3_5.py)."""
    types = cfg.get("layer_types") or []
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ConversionError(f"{family} with layer_types[{i}]={t!r} cannot be mapped exactly to megatron-core "
                                  f"(accepted: {', '.join(map(repr, LAYER_TYPES))})")
    if len(types) != cfg.get("num_hidden_layers"):
        raise ConversionError(f"config.json has {len(types)} layer_types for num_hidden_layers="
                              f"{cfg.get('num_hidden_layers')!r}; expected one per layer")
    sizes = positive_ints(cfg, LINEAR_KEYS)
    if sizes["v_heads"] % sizes["k_heads"]:
        raise ConversionError(f"config.json has linear_num_value_heads={sizes['v_heads']} not a multiple of "
                              f"linear_num_key_heads={sizes['k_heads']}: each key head serves whole value heads")
    return {"linear_attention": sizes, "linear_layers": "".join(LAYER_TYPES[t] for t in types), "qk_norm": True}


QWEN3_NEXT = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    architecture="Qwen3NextForCausalLM",
    rows=COMMON_ROWS + FULL_ROWS + LINEAR_ROWS + GATE_PROJ_EXPERT_ROWS
    + shared_expert_rows(S + ".gate_proj.weight", S + ".up_proj.weight", S + ".down_proj.weight", S + "_gate.weight")
    + DENSE_LAYER_ROWS,
    partial_rotary=True,
    refuse_flags=("attention_bias",),
    megatron={"layernorm_zero_centered_gamma": True, "attention_output_gate": True},
    read=read,
    layer=CustomLayer(qk_norm="head"),
    router=replace(QWEN2_MOE.router, experts_keys=("num_experts",)),
    mtp_prefix="mtp.",
)
