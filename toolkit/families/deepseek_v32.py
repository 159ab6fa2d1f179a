"""DeepSeek-V3.2 / V3.2-Exp (DeepseekV32ForCausalLM): DeepSeek-V3 (toolkit/families/deepseek_v3.py: its
multi-latent attention, YaRN, sigmoid router with groups and expert bias, shared experts, dense first
layers) with DeepSeek Sparse Attention's lightning indexer in every attention layer (toolkit/families/dsa.py),
megatron-core's DSAttention as the core attention of its MLASelfAttention (toolkit/blocks/attention_dsa.py).

transformers 5.24's DeepseekV32Config has no rope_interleave (the attention always de-interleaves, as
megatron-core's MLA does) and names the dense layers in mlp_layer_types as well as first_k_dense_replace:
the two must agree. The multi-token-prediction layer the published checkpoint stores after the decoder
layers (HF ignores `model.layers.61.*` on load) is left out with a line, as DeepSeek-V3's."""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.deepseek_v3 import DEEPSEEK_V3
from toolkit.families.dsa import DSA_ROWS, read_dsa
from toolkit.families.mla import read_mla


def read_dense_layers_agree(cfg: dict) -> None:
    """mlp_layer_types must say what first_k_dense_replace does (the router's reading uses the latter)."""
    layers, dense = cfg.get("num_hidden_layers"), cfg.get("first_k_dense_replace") or 0
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None and list(kinds) != ["dense"] * min(dense, layers) + ["sparse"] * (layers - min(dense, layers)):
        raise ConversionError(f"mlp_layer_types={kinds!r} is not first_k_dense_replace={dense} dense layers then "
                              "sparse ones: set one to agree with the other")


def read(cfg: dict) -> dict:
    read_dense_layers_agree(cfg)
    return {"mla": read_mla({"rope_interleave": True, **cfg}), "dsa": read_dsa(cfg)}


DEEPSEEK_V32 = replace(
    DEEPSEEK_V3,
    name="deepseek_v32",
    model_types=("deepseek_v32",),
    config_class_of={},
    architecture="DeepseekV32ForCausalLM",
    rows=DEEPSEEK_V3.rows + DSA_ROWS,
    read=read,
)
