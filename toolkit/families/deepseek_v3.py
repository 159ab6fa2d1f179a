"""DeepSeek-V3 / V3.1 / R1 (DeepseekV3ForCausalLM), and Kimi-K2 (model_type kimi_k2, read through
DeepseekV3Config), which reuses the architecture:
multi-latent attention (toolkit/families/mla.py) with YaRN or plain RoPE (toolkit/families/yarn.py),
and GLM-4.5's MoE layout (toolkit/families/sigmoid_router.py): sigmoid scores with an expert bias,
group-limited top-k, routed_scaling_factor, ungated shared experts, dense layers below
first_k_dense_replace.

The multi-token-prediction layer of the published checkpoints (num_nextn_predict_layers, stored as
`model.layers.<num_hidden_layers>.*`) is not part of HF's DeepseekV3ForCausalLM, which ignores it on
load: the converter leaves it out too, with a line saying so (Family.mtp_key). The published FP8
weights are dequantized while reading (toolkit/convert/fp8.py)."""

from toolkit.families.llama import BY_NAME
from toolkit.families.mla import MLA_ROWS, read_mla
from toolkit.families.sigmoid_router import DEEPSEEK_MOE_ROWS, DEEPSEEK_ROUTER
from toolkit.families.table import Family

EMBEDDING_AND_HEAD = tuple(BY_NAME[n] for n in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                                                "output_layer.weight"))

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    # Kimi-K2 ships model_type "kimi_k2" with auto_map to DeepSeek's own DeepseekV3Config (Moonshot's
    # deployment guide: frameworks without it may set "deepseek_v3"); transformers 5.23 has no kimi_k2
    model_types=("deepseek_v3", "kimi_k2"),
    config_class_of={"kimi_k2": "deepseek_v3"},
    architecture="DeepseekV3ForCausalLM",
    rows=EMBEDDING_AND_HEAD + MLA_ROWS + DEEPSEEK_MOE_ROWS,
    rope_types=("default", "yarn"),
    read=lambda cfg: {"mla": read_mla(cfg)},
    mtp_key="num_nextn_predict_layers",
    router=DEEPSEEK_ROUTER,
)
