"""Gemma 4 (text: gemma4_text, Gemma4ForCausalLM; the published 31B and 26B-A4B are multimodal wrappers,
toolkit/convert/wrapper.py). Each piece of transformers 5.24's modeling_gemma4.py as megatron-core
expresses it:

  layer_types sliding / full        window_attn_skip_freq (1: sliding, window `sliding_window`), as Gemma 3;
                                    ModelSpec.linear_layers "0" / "2" keys the rows of each kind, and every
                                    layer on its own in torch_dist (hetereogenous_dist_checkpoint)
  global head_dim, KV heads         per_layer_config (from global_head_dim, num_global_key_value_heads):
                                    the global layers' SelfAttention built from a copy of the config with
                                    kv_channels / num_query_groups of their own (toolkit/blocks/attention_self.py
                                    Gemma4SelfAttention); q/k/v fused per group as any layer (Split.GLOBAL_QKV)
  attention_k_eq_v                  global layers without v_proj: value = k_proj's output before k_norm and
                                    RoPE; linear_qkv holds [q; k] per group (Split.GLOBAL_QK) and repeats
                                    each group's k as its v (KeyIsValueLinear)
  q_norm, k_norm; v_norm            per-head RMSNorms of weight w (Gemma4RMSNorm: not 1 + w), qk_layernorm;
                                    the values' scale-free RMSNorm after the projection (ValueNorm)
  scaling = 1.0                     softmax_scale 1.0
  RoPE per layer type               each layer its own RotaryEmbedding: sliding the default RoPE of its
                                    rope_theta over head_dim; global the proportional one (frequencies
                                    base ** (-2i / head_dim) for i < partial_rotary_factor * head_dim / 2,
                                    0 beyond: those dimensions pass through), as HF's inv_freq exactly
  input / post-attention / pre- and post-feedforward norms   the toolkit's pre/post norms (Gemma 3's), w
  embed_tokens * sqrt(hidden)       CustomLayer.embedding_scale
  layer_scalar (a stored buffer)    each layer's output times it (ScaledTransformerLayer)
  final_logit_softcapping           cap * tanh(logits / cap) on the output layer's logits (toolkit/blocks/decoder_spec.py)

Refused in one line, naming the field: per-layer input embeddings (hidden_size_per_layer_input),
shared KV layers (num_kv_shared_layers), use_double_wide_mlp (only on shared-KV layers), the MoE block
(enable_moe_block: a dense MLP and 128 experts side by side, each with norms of its own, megatron-core's
MoE layer replaces the MLP), use_bidirectional_attention='all', attention biases. use_bidirectional_attention
='vision' (as published) converts: it makes image tokens attend both ways, text alone stays causal."""

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.gemma3 import GEMMA3, LAYER_TYPES, layer_types
from toolkit.families.llama import L, M
from toolkit.families.experts import LOCAL_EXPERT
from toolkit.families.router import Router
from toolkit.families.table import (FULL_ATTENTION, FUSED_HALVES, GLOBAL_ATTENTION, GLOBAL_LAYER, MOE_LAYER,
                                    CustomLayer, Family, FusedExperts, row)
from toolkit.splits import Split

G = GEMMA3.rows
_BY_NAME = {r.megatron: r for r in G}
QKV, PROJ = M + "self_attention.linear_qkv.weight", M + "self_attention.linear_proj.weight"
Q_NORM, K_NORM = M + "self_attention.q_layernorm.weight", M + "self_attention.k_layernorm.weight"
ATTENTION = (QKV, PROJ, Q_NORM, K_NORM)
A = L + "self_attn."

FFN = (M + "mlp.linear_fc1.layer_norm_weight", M + "mlp.linear_fc1.weight", M + "mlp.linear_fc2.weight",
       M + "mlp.linear_fc2.post_layernorm.weight")
COMMON_ROWS = tuple(r for r in G if r.megatron not in ATTENTION + FFN) + (
    row(M + "layer_scalar", L + "layer_scalar", Split.REPLICATED, ("one",)),
)
DENSE_ROWS = tuple(replace(_BY_NAME[name], when="is_dense") for name in FFN)


def _moe(megatron: str, hf, split, *shapes) -> object:
    return row(M + "mlp." + megatron, hf, split, *shapes, kind=MOE_LAYER, when="is_moe")


def _norm(megatron: str, hf: str) -> object:
    return _moe(megatron + ".weight", L + hf + ".weight", Split.REPLICATED, ("hidden",))


# enable_moe_block (the 26B-A4B): Gemma4MoELayer (toolkit/blocks/moe_layers.py), its experts read from HF's fused tensors
MOE_ROWS = (
    _moe("router.weight", L + "router.proj.weight", Split.REPLICATED, ("experts", "hidden")),
    _moe("router.scale", L + "router.scale", Split.REPLICATED, ("hidden",)),
    _moe("router.per_expert_scale", L + "router.per_expert_scale", Split.REPLICATED, ("experts",)),
    row(LOCAL_EXPERT + "linear_fc1.weight", (L + "experts.#.gate_proj.weight", L + "experts.#.up_proj.weight"),
        Split.GATE_UP, ("moe_ffn", "hidden"), ("moe_ffn", "hidden"), kind=MOE_LAYER, when="is_moe"),
    row(LOCAL_EXPERT + "linear_fc2.weight", L + "experts.#.down_proj.weight", Split.ROW, ("hidden", "moe_ffn"),
        kind=MOE_LAYER, when="is_moe"),
    _moe("dense.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), Split.GATE_UP,
         ("ffn", "hidden"), ("ffn", "hidden")),
    _moe("dense.linear_fc2.weight", L + "mlp.down_proj.weight", Split.ROW, ("hidden", "ffn")),
    _norm("dense_norm", "pre_feedforward_layernorm"),
    _norm("dense_post_norm", "post_feedforward_layernorm_1"),
    _norm("experts_norm", "pre_feedforward_layernorm_2"),
    _norm("experts_post_norm", "post_feedforward_layernorm_2"),
    _norm("post_norm", "post_feedforward_layernorm"),
)
SLIDING_ROWS = tuple(replace(_BY_NAME[name], attention=FULL_ATTENTION) for name in ATTENTION)
GLOBAL_ROWS = (
    row(QKV, (A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"), Split.GLOBAL_QKV,
        ("g_q_size", "hidden"), ("g_kv_size", "hidden"), ("g_kv_size", "hidden"), attention=GLOBAL_ATTENTION,
        when="global_own_v"),
    row(QKV, (A + "q_proj.weight", A + "k_proj.weight"), Split.GLOBAL_QK, ("g_q_size", "hidden"), ("g_kv_size", "hidden"),
        attention=GLOBAL_ATTENTION, when="global_k_eq_v"),
    row(PROJ, A + "o_proj.weight", Split.ROW, ("hidden", "g_q_size"), attention=GLOBAL_ATTENTION),
    row(Q_NORM, A + "q_norm.weight", Split.REPLICATED, ("g_head_dim",), attention=GLOBAL_ATTENTION),
    row(K_NORM, A + "k_norm.weight", Split.REPLICATED, ("g_head_dim",), attention=GLOBAL_ATTENTION),
)

# config.json fields whose feature has no exact megatron-core counterpart here yet, each refused naming it
UNMAPPED = {
    "hidden_size_per_layer_input": "per-layer input embeddings (embed_tokens_per_layer, per_layer_model_projection)",
    "num_kv_shared_layers": "layers reusing an earlier layer's keys and values",
    "use_double_wide_mlp": "double-width MLPs on the shared-KV layers",
}


def _sliding_rope_theta(cfg: dict) -> float:
    local = cfg["rope_parameters"].get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConversionError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r}: only the default "
                              "RoPE on gemma4's sliding layers maps exactly to megatron-core")
    return float(local["rope_theta"])


def _global_rope(cfg: dict) -> tuple[float, float]:
    full = cfg["rope_parameters"].get("full_attention") or {}
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ConversionError(f"rope_parameters.full_attention.rope_type={kind!r}: only the default and the "
                              "proportional RoPE on gemma4's global layers map exactly to megatron-core")
    if float(full.get("factor", 1.0)) != 1.0:
        raise ConversionError(f"rope_parameters.full_attention.factor={full['factor']!r}: only 1.0 maps exactly")
    partial = float(full.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return float(full["rope_theta"]), partial


def read(cfg: dict) -> dict:
    for key, what in UNMAPPED.items():
        if cfg.get(key):
            raise ConversionError(f"gemma4 with {key}={cfg[key]!r} cannot be mapped exactly to megatron-core ({what})")
    types = layer_types(cfg, "gemma4")
    if len(types) != cfg["num_hidden_layers"]:
        raise ConversionError(f"config.json has {len(types)} layer_types for num_hidden_layers="
                              f"{cfg['num_hidden_layers']!r}; expected one per layer")
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if set(per_layer) - set(full):
        raise ConversionError(f"gemma4 with per_layer_config for layers {sorted(set(per_layer) - set(full))}: only the "
                              "global (full_attention) layers may differ from the model's head sizes")
    overrides = [per_layer.get(i, {}) for i in full]
    if any(o != overrides[0] for o in overrides) or any(set(o) - {"head_dim", "num_key_value_heads"} for o in overrides):
        raise ConversionError(f"gemma4 with per_layer_config={cfg.get('per_layer_config')!r}: the global layers must "
                              "share one head_dim and num_key_value_heads")
    first = overrides[0] if overrides else {}
    theta, partial = _global_rope(cfg)
    return {
        "window_layers": "".join(LAYER_TYPES[t] for t in types),
        "linear_layers": "".join(GLOBAL_LAYER if t == "full_attention" else "0" for t in types),
        "window_rope_theta": _sliding_rope_theta(cfg),
        "softmax_scale": 1.0,
        "qk_norm": True,
        "final_logit_softcapping": (float(cfg["final_logit_softcapping"])
                                    if cfg.get("final_logit_softcapping") is not None else None),
        "global_attention": {
            "head_dim": int(first.get("head_dim", cfg["head_dim"])),
            "kv_heads": int(first.get("num_key_value_heads", cfg["num_key_value_heads"])),
            "k_eq_v": bool(cfg.get("attention_k_eq_v")),
            "rope_theta": theta,
            "partial_rotary_factor": partial,
        },
    }


GEMMA4 = Family(
    name="gemma4",
    model_types=("gemma4_text",),
    architecture="Gemma4ForCausalLM",
    rows=COMMON_ROWS + SLIDING_ROWS + GLOBAL_ROWS + DENSE_ROWS + MOE_ROWS,
    window_key="sliding_window",
    refuse_flags=("attention_bias",),
    # "vision": image tokens attend to each other both ways, text causally, so text alone is causal (Gemma4Model's
    # masks); "all" (no causal mask anywhere) is refused
    accepted={"use_bidirectional_attention": ("vision",)},
    rope_types=("default", "proportional"),
    rope_key="full_attention",
    activation=("hidden_activation", "gelu_pytorch_tanh"),
    # every layer keyed on its own in torch_dist: global and sliding layers differ in shape
    megatron={"hetereogenous_dist_checkpoint": True},
    read=read,
    layer=CustomLayer(pre_norms=True, post_norms=True, qk_norm="head", embedding_scale=True, gemma4=True),
    # the experts only with enable_moe_block; Gemma4TextRouter always renormalises its top-k
    router=Router(experts_keys=("num_experts",), ffn_key="moe_intermediate_size", topk_key="top_k_experts",
                  when="enable_moe_block"),
    # Gemma4TextExperts: gate_up [experts, 2 x ffn, hidden] as [gate; up] halves, down [experts, hidden, ffn], as
    # linear, no biases; the export writes them fused, as the published checkpoints store them
    fused_experts=FusedExperts(prefix=L + "experts.", per_expert=L + "experts.#.", gate_up="gate_up_proj",
                               down="down_proj", layout=FUSED_HALVES),
)
