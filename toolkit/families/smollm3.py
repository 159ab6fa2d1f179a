"""SmolLM3: Llama's tensors (GQA, SwiGLU, RMSNorm) with RoPE skipped on some layers (NoPE).

  HF (transformers 5.24)                  megatron-core
  no_rope_layers[i] (1: RoPE, 0: NoPE;    no_rope_freq as a list, 1 where RoPE is skipped
  from no_rope_layer_interval where       (transformer_config.py no_rope_freq; attention.py: the layer's
  the file has none: every 4th NoPE)      rotary_pos_emb set to None), in 0.16.1 as in 0.19

The list is read as SmolLM3Config resolves it, its first num_hidden_layers entries (the class takes one
at least as long as the model). SmolLM3's sliding window (use_sliding_window, on NoPE layers only) is
off in every published checkpoint and refused.
"""

from toolkit.errors import ConversionError
from toolkit.families.llama import ROWS
from toolkit.families.table import Family


def read(cfg: dict) -> dict:
    layers, flags = int(cfg["num_hidden_layers"]), cfg["no_rope_layers"]
    if not isinstance(flags, list) or len(flags) < layers:
        raise ConversionError(f"smollm3 with no_rope_layers={flags!r}: needs one entry per layer ({layers})")
    for i, flag in enumerate(flags[:layers]):
        if flag not in (0, 1):
            raise ConversionError(f"smollm3 with no_rope_layers[{i}]={flag!r} cannot be mapped exactly to "
                                  "megatron-core (1: RoPE, 0: NoPE)")
    nope = "".join("0" if flag else "1" for flag in flags[:layers])
    return {"nope_layers": nope if "1" in nope else None}


SMOLLM3 = Family(
    name="smollm3",
    model_types=("smollm3",),
    architecture="SmolLM3ForCausalLM",
    rows=ROWS,
    # the window applies to NoPE layers only where use_sliding_window (modeling_smollm3.py:193-197)
    refuse_flags=("attention_bias", "mlp_bias", "use_sliding_window"),
    accepted={"layer_types": ("full_attention",)},
    rope_types=("default", "yarn"),
    read=read,
)
