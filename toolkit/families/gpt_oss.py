"""gpt-oss (GptOssForCausalLM, gpt-oss-20b / -120b): Llama's layout with q/k/v/o biases, a learnable
attention-sink logit per head, sliding-window layers alternating with full ones (layer_types), YaRN
RoPE, and in every layer a router with a bias (softmax over the top-k logits) to experts with biases
and a clamped SwiGLU. Each piece as megatron-core 0.16.1 expresses it:

  sinks (self_attn.sinks [heads])   DotProductAttention.softmax_offset, softmax_type='learnable'
                                    (dot_product_attention.py:126-138; fused_softmax.py:154-176 SoftmaxOne
                                    appends it as one more logit per row and drops its column, as HF's
                                    eager_attention_forward does)
  layer_types, sliding_window       window_size=(sliding_window - 1, 0), window_attn_skip_freq as a list
                                    (utils.py:451 is_layer_window_attention)
  rope_parameters yarn              position_embedding_type='yarn' and the yarn_* config attributes
                                    (toolkit/families/yarn.py)
  attention_bias (q/k/v/o)          add_bias_linear (linear_qkv.bias, linear_proj.bias)
  mlp.router.weight / .bias         TopKRouter.weight / .bias (router.py:53-61, add_bias_linear), top-k
                                    of the logits then softmax over those k (moe_router_pre_softmax off)
  experts' clamped SwiGLU           activation_func=quick_gelu (x * sigmoid(1.702 x): swiglu_alpha 1.702
                                    only), activation_func_clamp_value=swiglu_limit, glu_linear_offset=1
                                    (mlp.py:219-226: gate clamped above, up clamped both sides, act(gate) *
                                    (up + 1)), experts' fc1/fc2 biases (add_bias_linear)

HF stores the experts fused: gate_up_proj [experts, hidden, 2 x ffn] with gate and up interleaved
along the last dimension (gate = [..., ::2]), down_proj [experts, ffn, hidden], both applied as x @ W;
the published checkpoints store them in MXFP4 (`*_blocks`, `*_scales`). The converter reads them per
expert (toolkit/convert/fused_experts.py) under the names the rows below use.

megatron-core supports biases in MoE layers only with expert tensor parallelism 1
(transformer_config.py:1588): the experts are whole on every TP rank (Split.UNSPLIT_*, and
expert_tensor_parallel_size=1 where the model is built, toolkit/megatron_settings.py)."""

from toolkit.errors import ConversionError
from toolkit.families.experts import ATTENTION_ROWS, LOCAL_EXPERT
from toolkit.families.gemma3 import LAYER_TYPES, layer_types
from toolkit.families.llama import L, M
from toolkit.families.qwen2 import QWEN2
from toolkit.families.router import Router
from toolkit.families.table import FUSED_INTERLEAVED, MOE_LAYER, Family, FusedExperts, row
from toolkit.splits import Split

# megatron-core's quick_gelu is x * sigmoid(1.702 * x) (fusions/fused_bias_geglu.py)
QUICK_GELU_ALPHA = 1.702
# HF's clamped SwiGLU multiplies by (up + 1) (GptOssExperts._apply_gate)
GLU_OFFSET = 1.0
# transformers 5.19 made swiglu_alpha and swiglu_limit GptOssConfig fields that GptOssExperts reads; 5.17
# and 5.18 fix them at these values in GptOssExperts.__init__, whatever config.json says.
FIXED_BEFORE_TRANSFORMERS_5_19 = {"swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0}


def installed_transformers_reads_swiglu() -> bool:
    """Whether the installed transformers' GptOss model computes with config.json's swiglu_* values."""
    from transformers import GptOssConfig

    return hasattr(GptOssConfig, "swiglu_limit")


def _swiglu_as_the_installed_model_computes(cfg: dict) -> dict:
    if installed_transformers_reads_swiglu():
        return cfg
    import transformers

    for key, fixed in FIXED_BEFORE_TRANSFORMERS_5_19.items():
        if cfg.get(key, fixed) != fixed:
            raise ConversionError(
                f"config.json has {key}={cfg[key]!r}, which transformers {transformers.__version__} ignores (before "
                f"5.19 its GptOssExperts computes with {key}={fixed}), so this checkpoint is another model there: "
                f"install transformers>=5.19 to convert it")
    return {**cfg, **FIXED_BEFORE_TRANSFORMERS_5_19}

X = L + "mlp.experts.#."  # the per-expert names toolkit/convert/fused_experts.py reads the fused tensors under
QKV_BIAS = tuple(r for r in QWEN2.rows if r.megatron.endswith("linear_qkv.bias"))
ROWS = ATTENTION_ROWS + QKV_BIAS + (
    row(M + "self_attention.linear_proj.bias", L + "self_attn.o_proj.bias", Split.REPLICATED, ("hidden",)),
    row(M + "self_attention.core_attention.softmax_offset", L + "self_attn.sinks", Split.COLUMN, ("heads",)),
    row(M + "mlp.router.weight", L + "mlp.router.weight", Split.REPLICATED, ("experts", "hidden"), kind=MOE_LAYER),
    row(M + "mlp.router.bias", L + "mlp.router.bias", Split.REPLICATED, ("experts",), kind=MOE_LAYER),
    row(LOCAL_EXPERT + "linear_fc1.weight", (X + "gate_proj.weight", X + "up_proj.weight"), Split.UNSPLIT_GATE_UP,
        ("moe_ffn", "hidden"), ("moe_ffn", "hidden"), kind=MOE_LAYER),
    row(LOCAL_EXPERT + "linear_fc1.bias", (X + "gate_proj.bias", X + "up_proj.bias"), Split.UNSPLIT_GATE_UP,
        ("moe_ffn",), ("moe_ffn",), kind=MOE_LAYER),
    row(LOCAL_EXPERT + "linear_fc2.weight", X + "down_proj.weight", Split.UNSPLIT_ROW, ("hidden", "moe_ffn"), kind=MOE_LAYER),
    row(LOCAL_EXPERT + "linear_fc2.bias", X + "down_proj.bias", Split.REPLICATED, ("hidden",), kind=MOE_LAYER),
)


def read(cfg: dict) -> dict:
    cfg = _swiglu_as_the_installed_model_computes(cfg)
    alpha = cfg.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ConversionError(f"gpt_oss with swiglu_alpha={alpha!r} cannot be mapped exactly to megatron-core: its "
                              f"clamped GLU takes quick_gelu, x * sigmoid({QUICK_GELU_ALPHA} x) (fused_bias_geglu.py)")
    limit = cfg.get("swiglu_limit")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
        raise ConversionError(f"config.json has swiglu_limit={limit!r}; expected a finite number > 0")
    if not cfg.get("attention_bias"):
        raise ConversionError("gpt_oss with attention_bias=false cannot be mapped exactly to megatron-core: "
                              "add_bias_linear puts a bias on every linear layer, the experts' and the router's too")
    return {"window_layers": "".join(LAYER_TYPES[t] for t in layer_types(cfg, "gpt_oss")),
            "attention_sinks": True, "linear_bias": True, "glu_clamp": float(limit), "glu_offset": GLU_OFFSET}


GPT_OSS = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architecture="GptOssForCausalLM",
    rows=ROWS,
    qkv_bias=True,
    window_key="sliding_window",
    rope_types=("default", "yarn"),
    read=read,
    router=Router(experts_keys=("num_local_experts",), ffn_key="intermediate_size"),
    fused_experts=FusedExperts(
        prefix=L + "mlp.experts.", per_expert=X, gate_up="gate_up_proj", down="down_proj",
        gate_up_bias="gate_up_proj_bias", down_bias="down_proj_bias", layout=FUSED_INTERLEAVED, mxfp4=True),
)
