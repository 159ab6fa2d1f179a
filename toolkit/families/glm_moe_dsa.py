"""GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa): transformers 5.24 builds it from DeepSeek-V3.2's modules
(modular_glm_moe_dsa.py), so its table is DeepSeek-V3.2's (toolkit/families/deepseek_v32.py: MLA, the lightning
indexer of toolkit/families/dsa.py, the sigmoid router, shared experts, dense first layers) with what differs:

  indexer RoPE          interleaved (apply_rotary_pos_emb_interleave) where DeepSeek-V3.2's is half-split:
                        megatron-core's dsa_indexer_rope_interleaved (q and k de-interleaved alike, so q . k as HF's)
  q_a_layernorm,        AXK1RMSNorm at its default eps 1e-6 whatever rms_norm_eps says (1e-5 as published, which the
  kv_a_layernorm        layer norms take): LatentRMSNorm (toolkit/blocks/norms.py) keeps 1e-6 there
  indexer_types         "shared" layers reuse the latest full layer's top-k (IndexShare, GLM-5.1 / 5.2's
                        index_topk_freq / index_skip_topk_offset): megatron-core's dsa_indexer_topk_freq /
                        dsa_indexer_skip_topk_offset (DSAttention builds no indexer there, the table's indexer rows
                        are on the full layers only: ModelSpec.linear_layers "3"); a pattern of another shape refused.
                        megatron-core shares within a pipeline stage only: each stage must begin with a full layer
  router                DeepSeek-V3's sigmoid router (n_group 1 as published: no group ever left out)

The MTP layer the checkpoint stores after the decoder layers (HF ignores `model.layers.78.*`) is left out with a line.
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.deepseek_v32 import DEEPSEEK_V32, read_dense_layers_agree
from toolkit.families.dsa import read_dsa
from toolkit.families.mla import read_mla
from toolkit.families.table import SHARED_INDEX_LAYER


def read_index_share(cfg: dict) -> dict:
    """IndexShare: indexer_types ("full" / "shared" per layer) as megatron-core's schedule, dsa_indexer_topk_freq and
    dsa_indexer_skip_topk_offset (dsa.py is_dsa_skip_topk_layer: layer n, from 1, reuses the top-k of the latest
    computing layer unless max(n - offset, 0) % freq == 0), and ModelSpec.linear_layers ("0" computing, "3" shared:
    the indexer's rows on the former only); {} where every layer computes its own. Refused in one line where no
    schedule gives HF's layers."""
    kinds = list(cfg.get("indexer_types") or ())
    if "shared" not in kinds:
        return {}
    if set(kinds) - {"full", "shared"}:
        raise ConversionError(f"indexer_types={kinds!r}: expected 'full' or 'shared' per layer")
    offset = kinds.index("shared")  # the leading computing layers
    later = [i for i in range(offset, len(kinds)) if kinds[i] == "full"]
    freq = later[0] - offset + 1 if later else len(kinds)
    schedule = ["shared" if max(n - offset, 0) % freq else "full" for n in range(1, len(kinds) + 1)]
    if offset < 1 or schedule != kinds:
        raise ConversionError(f"indexer_types={kinds!r} is not megatron-core's schedule of a computing layer every "
                              "dsa_indexer_topk_freq after dsa_indexer_skip_topk_offset leading ones (as index_topk_freq "
                              "and index_skip_topk_offset give it): it cannot share the top-k as HF does")
    return {"topk_freq": freq, "skip_topk_offset": offset,
            "layers": "".join("0" if kind == "full" else SHARED_INDEX_LAYER for kind in kinds)}


def read(cfg: dict) -> dict:
    read_dense_layers_agree(cfg)
    share = read_index_share(cfg)
    layers = share.pop("layers", None)
    return {"mla": read_mla({"rope_interleave": True, **cfg}),
            "dsa": {**read_dsa(cfg, rope_interleaved=True), **share}, "linear_layers": layers}


GLM_MOE_DSA = replace(
    DEEPSEEK_V32,
    name="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    architecture="GlmMoeDsaForCausalLM",
    read=read,
)
