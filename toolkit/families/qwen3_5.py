"""Qwen3.5 / Qwen3.6 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; published as the vision-language wrappers
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, whose language model this is:
toolkit/convert/wrapper.py). transformers 5.24 builds it from Qwen3-Next's modules (modular_qwen3_5.py),
so this table is Qwen3-Next's (toolkit/families/qwen3_next.py) with what differs:

  linear_attn.in_proj_qkv, _z,      GatedDeltaNet.in_proj [q; k; v; z; beta; alpha]: HF keeps four Linears
  _b, _a                            already in that order, value heads as Qwen3-Next's (key head i serves
                                    value heads i*r .. i*r + r - 1, torch_chunk_gated_delta_rule's
                                    repeat_interleave), so concatenated: Split.GDN_IN_PROJ_CAT, GDN_IN_PROJ's
                                    TP parts and torch_dist keys without Qwen3-Next's per-key-head regrouping
  the rotary embedding (MRoPE)      Qwen3_5TextRotaryEmbedding computes cos/sin of position * inv_freq once
                                    per stream (T, H, W) and copies the H and W streams' values into T's at
                                    the interleaved indices of mrope_section; mrope_interleaved is never
                                    read. For text the three streams hold the same positions, so the copy
                                    writes the values already there: plain RoPE (rotate-half, partial
                                    rotary on the first int(head_dim * partial_rotary_factor) dimensions),
                                    bit for bit, whatever mrope_section is (tests/test_family_qwen3_5.py)
  dense MLP (qwen3_5)               every layer Llama's gate/up/down (no experts, no mlp_only_layers)
  mlp (qwen3_5_moe)                 every layer MoE: Qwen3-Next's router, experts and gated shared expert,
                                    the top-k always renormalised (Qwen3VLMoeTextTopKRouter: the config class
                                    deletes norm_topk_prob, mlp_only_layers, decoder_sparse_step)
  mlp.experts.gate_up_proj          Qwen3_5MoeExperts' fused tensors, where a checkpoint holds them (its
  [E, 2 x ffn, hidden], down_proj   conversion mapping loads per-expert files too): gate and up as halves
  [E, hidden, ffn], no biases       (nn.functional.linear, `.chunk(2, dim=-1)`), read per expert into each
                                    local expert's linear_fc1 [gate; up] and linear_fc2 (FusedExperts,
                                    layout FUSED_HALVES; toolkit/convert/fused_experts.py). The export writes
                                    per-expert tensors, as transformers' own save_pretrained does

The rest is Qwen3-Next's: output-gated attention (GATED_QKV), per-head q/k norms, (1 + w) RMSNorms but
the gated delta net's own norm (w), conv1d, dt_bias, A_log, out_proj, attention_bias refused, the
multi-token-prediction layers (`mtp.*`, ignored by HF's model) left out. attn_output_gate and
mamba_ssm_dtype, in the published text_config, are read by no transformers class: HF always gates and
computes the state in the input's dtype (fp32 here)."""

from dataclasses import replace

from toolkit.families import qwen3_next
from toolkit.families.experts import GATE_PROJ_EXPERT_ROWS, shared_expert_rows
from toolkit.families.llama import BY_NAME, M
from toolkit.families.qwen2_moe import S
from toolkit.families.qwen3_next import QWEN3_NEXT, A, G
from toolkit.families.router import Router
from toolkit.families.table import FUSED_HALVES, LINEAR_ATTENTION, FusedExperts, row
from toolkit.splits import Split

IN_PROJ = row(G + "in_proj.weight", tuple(A + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
              Split.GDN_IN_PROJ_CAT, ("gdn_qkv", "hidden"), ("gdn_v_size", "hidden"), ("gdn_v_heads", "hidden"),
              ("gdn_v_heads", "hidden"), attention=LINEAR_ATTENTION)
LINEAR_ROWS = tuple(IN_PROJ if r.megatron == IN_PROJ.megatron else r for r in qwen3_next.LINEAR_ROWS)
MIXER_ROWS = qwen3_next.COMMON_ROWS + qwen3_next.FULL_ROWS + LINEAR_ROWS
DENSE_MLP_ROWS = (BY_NAME[M + "mlp.linear_fc1.weight"], BY_NAME[M + "mlp.linear_fc2.weight"])


def _read(family: str):
    return lambda cfg: qwen3_next.read(cfg, family)


QWEN3_5 = replace(
    QWEN3_NEXT,
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    architecture="Qwen3_5ForCausalLM",
    rows=MIXER_ROWS + DENSE_MLP_ROWS,
    read=_read("qwen3_5"),
    router=None,
)

QWEN3_5_MOE = replace(
    QWEN3_NEXT,
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    architecture="Qwen3_5MoeForCausalLM",
    rows=MIXER_ROWS + GATE_PROJ_EXPERT_ROWS
    + shared_expert_rows(S + ".gate_proj.weight", S + ".up_proj.weight", S + ".down_proj.weight", S + "_gate.weight"),
    read=_read("qwen3_5_moe"),
    ffn_key="moe_intermediate_size",
    router=Router(experts_keys=("num_experts",), ffn_key="moe_intermediate_size",
                  shared_ffn_key="shared_expert_intermediate_size", shared_expert_gate=True),
    # Qwen3_5MoeExperts' own tensors, where a checkpoint stores them so (transformers saves per expert)
    fused_experts=FusedExperts(prefix="model.layers.*.mlp.experts.", per_expert="model.layers.*.mlp.experts.#.",
                               gate_up="gate_up_proj", down="down_proj", layout=FUSED_HALVES, export_fused=False),
)
