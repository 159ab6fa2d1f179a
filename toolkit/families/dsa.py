"""DeepSeek Sparse Attention (DeepSeek-V3.2: DeepseekV32Indexer, transformers 5.24) as megatron-core 0.19's
DSAttention with its DSAIndexer (transformer/experimental_attention_variant/dsa.py), the core attention of
the multi-latent attention layer (toolkit/families/mla.py), read from config.json and mapped tensor by tensor.

HF's lightning indexer, per token (modeling_deepseek_v32.py DeepseekV32Indexer.forward), from the layer input x
and the normed low-rank query q_r = q_a_layernorm(q_a_proj(x)) the attention also uses:
    q   = wq_b(q_r) per head (index_n_heads x index_head_dim),  k = k_norm(wk(x)) (LayerNorm with a bias, eps 1e-6)
    RoPE, not interleaved (rotate_half), on the first qk_rope_head_dim dimensions of q and k, the rest passed
    score[s, t] = sum_h weights_proj(x)[s, h] / sqrt(index_n_heads) * relu(q[s, h] . k[t] / sqrt(index_head_dim))
    each query attends to the index_topk best-scoring keys among the causal ones (all where fewer)
megatron-core 0.19.2 computes the same (DSAIndexer.forward_before_topk, fused_qk_topk_naive): linear_wq_b of the
attention's q_compressed (after q_layernorm), linear_wk, k_norm (LayerNorm, eps dsa_indexer_k_norm_epsilon), RoPE on
the first qk_pos_emb_head_dim dimensions (x_pe first, as DeepSeek's) with dsa_indexer_rope_interleaved False,
relu(q . k) (dsa_indexer_scoring_relu) times weights / sqrt(heads) / sqrt(index_head_dim), top-k with the causal
mask added; the softmax then over the kept keys only (unfused_dsa_fn), which HF's mask leaves to its attention.
The two differ in one place, DeepSeek's Hadamard rotation of q and k (rotate_activation), which HF leaves out
because it is orthonormal (q . k unchanged): dsa_indexer_rotate_activation False (toolkit/megatron_settings.py).
The indexer reads its input detached in both (HF: torch.no_grad), so the language-model loss trains none of it.

Refused, each in one line: a full-rank query (q_lora_rank null: HF's indexer reads the low-rank one),
index_head_dim below qk_rope_head_dim. The indexer's tensors are replicated over TP, as megatron-core's
duplicated linears hold them. megatron-core before 0.19 cannot compute it exactly (toolkit/runtime/megatron_versions.py).
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.hf_values import positive_ints
from toolkit.families.llama import L, M
from toolkit.families.table import FULL_ATTENTION, row
from toolkit.splits import Split

HF_INDEXER = L + "self_attn.indexer."
INDEXER = M + "self_attention.core_attention.indexer."
# HF's DeepseekV32Indexer builds k_norm as nn.LayerNorm(index_head_dim, eps=1e-6), whatever rms_norm_eps says
HF_INDEXER_K_NORM_EPS = 1e-6

# On the layers whose indexer runs (FULL_ATTENTION; every layer but GLM-5's shared ones, ModelSpec.linear_layers "3")
DSA_ROWS = tuple(replace(r, attention=FULL_ATTENTION) for r in (
    row(INDEXER + "linear_wq_b.weight", HF_INDEXER + "wq_b.weight", Split.REPLICATED, ("index_q", "q_lora")),
    row(INDEXER + "linear_wk.weight", HF_INDEXER + "wk.weight", Split.REPLICATED, ("index_dim", "hidden")),
    row(INDEXER + "k_norm.weight", HF_INDEXER + "k_norm.weight", Split.REPLICATED, ("index_dim",)),
    row(INDEXER + "k_norm.bias", HF_INDEXER + "k_norm.bias", Split.REPLICATED, ("index_dim",)),
    # (transformers keeps it in float32 only under fp16: _keep_in_fp32_modules, not the strict list bf16 keeps)
    row(INDEXER + "linear_weights_proj.weight", HF_INDEXER + "weights_proj.weight", Split.REPLICATED,
        ("index_heads", "hidden")),
))

SIZES = {"heads": "index_n_heads", "head_dim": "index_head_dim", "topk": "index_topk"}


def read_dsa(cfg: dict, rope_interleaved: bool = False) -> dict:
    """ModelSpec.dsa: the indexer's heads, head_dim and topk, and whether its RoPE is interleaved (GLM-5's:
    apply_rotary_pos_emb_interleave, megatron-core's dsa_indexer_rope_interleaved); refusing what DSAIndexer
    computes otherwise."""
    if cfg.get("q_lora_rank") is None:
        raise ConversionError(f"{cfg.get('model_type')} with q_lora_rank=null cannot be mapped exactly: HF's indexer "
                              "reads the normed low-rank query (q_a_layernorm), which a full-rank query has none of")
    sizes = positive_ints(cfg, SIZES)
    if sizes["head_dim"] < cfg.get("qk_rope_head_dim", 0):
        raise ConversionError(f"index_head_dim={sizes['head_dim']} is below qk_rope_head_dim="
                              f"{cfg.get('qk_rope_head_dim')}: the indexer rotates that many of its dimensions")
    return {**sizes, "rope_interleaved": rope_interleaved}
