"""GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa): transformers 5.24 builds it from DeepSeek-V3.2's modules
(modular_glm_moe_dsa.py), so its table is DeepSeek-V3.2's (toolkit/families/deepseek_v32.py: MLA, the lightning
indexer of toolkit/families/dsa.py, the sigmoid router, shared experts, dense first layers) with what differs:

  indexer RoPE          interleaved (apply_rotary_pos_emb_interleave) where DeepSeek-V3.2's is half-split:
                        megatron-core's dsa_indexer_rope_interleaved (q and k de-interleaved alike, so q . k as HF's)
  q_a_layernorm,        AXK1RMSNorm at its default eps 1e-6 whatever rms_norm_eps says (1e-5 as published, which the
  kv_a_layernorm        layer norms take): LatentRMSNorm (toolkit/blocks/norms.py) keeps 1e-6 there
  indexer_types         "shared" layers reuse the previous full layer's top-k (IndexShare, GLM-5.1 / 5.2's
                        index_topk_freq): refused in one line, naming the field (megatron-core's
                        dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset would express it; the indexer rows
                        per layer are not written yet)
  router                DeepSeek-V3's sigmoid router (n_group 1 as published: no group ever left out)

The MTP layer the checkpoint stores after the decoder layers (HF ignores `model.layers.78.*`) is left out with a line.
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.deepseek_v32 import DEEPSEEK_V32, read_dense_layers_agree
from toolkit.families.dsa import read_dsa
from toolkit.families.mla import read_mla


def refuse_shared_indexers(cfg: dict) -> None:
    shared = [i for i, kind in enumerate(cfg.get("indexer_types") or ()) if kind != "full"]
    if shared:
        raise ConversionError(f"indexer_types names layers {shared[:4]}{'...' if len(shared) > 4 else ''} "
                              f"{cfg['indexer_types'][shared[0]]!r}: their top-k reused from an earlier layer "
                              "(IndexShare) is not converted yet; only configs whose every layer is 'full'")


def read(cfg: dict) -> dict:
    read_dense_layers_agree(cfg)
    refuse_shared_indexers(cfg)
    return {"mla": read_mla({"rope_interleave": True, **cfg}, latent_norms_own_eps=True),
            "dsa": read_dsa(cfg, rope_interleaved=True)}


GLM_MOE_DSA = replace(
    DEEPSEEK_V32,
    name="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    architecture="GlmMoeDsaForCausalLM",
    read=read,
)
