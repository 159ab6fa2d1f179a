"""Llama 4 (Llama4ForCausalLM, model_type llama4_text; Scout 17B-16E and Maverick 17B-128E are published as the
vision-language wrapper Llama4ForConditionalGeneration, model_type llama4, whose language model this is:
toolkit/convert/wrapper.py). Piece by piece against transformers 5.24's modeling_llama4.py:

  self_attn q/k/v/o_proj            Llama's tensors (GQA, no biases; attention_bias refused)
  RoPE (apply_rotary_emb)           the complex product of each head's (2i, 2i + 1) pairs: megatron-core's
                                    rotary_interleaved (rope_utils.py _rotate_half), no re-layout of q/k;
                                    rope_parameters default or llama3 (megatron-core's fixed low / high freq
                                    factors and 8192 original positions: Scout and Maverick base; others refused)
  no_rope_layers[i] (1 RoPE, 0 NoPE) megatron-core's no_rope_freq as a list (as SmolLM3), 1 where RoPE is skipped
  qk_norm (use_qk_norm, RoPE layers) Llama4TextL2Norm(rms_norm_eps): x / sqrt(mean(x^2) + eps) per head, no weight,
                                    after RoPE; megatron-core's L2Norm (eps layernorm_epsilon) per head before
                                    RoPE: the same, RoPE being a rotation of each pair (it keeps the head's norm);
                                    on the RoPE layers only (CustomLayer qk_norm "l2_rope", toolkit/blocks/decoder_spec.py)
  attn_temperature_tuning           NoPE layers' queries times log1p(floor((position + 1) / floor_scale)) *
                                    attn_scale + 1: exactly 1 below position floor_scale - 1, so exact up to
                                    floor_scale - 1 tokens (8191 as published; ModelSpec.exact_seq_len)
  attention_chunk_size              RoPE layers (layer_types "chunked_attention") attend within chunks of that
                                    many tokens (create_chunked_causal_mask): within one chunk plain causal
                                    attention, so exact up to attention_chunk_size tokens (8192 as published),
                                    ms-swift's route; megatron-core (0.16.1 to 0.19) has no chunked mask, and
                                    longer sequences are refused in one line (exact_seq_len), not approximated
  feed_forward (Llama4TextMoe)      on moe_layers (from interleave_moe_layer_step): Llama4Router, top-1 of the
                                    logits, its weight sigmoid(logit) (the others -inf -> 0), applied to the
                                    expert's INPUT (routed_in = x * score): megatron-core's sigmoid router at
                                    top-1 (no renormalisation at k 1) with moe_apply_probs_on_input (which
                                    requires top-1; num_experts_per_tok other than 1 refused); the experts
                                    Llama4TextExperts, fused as x @ W: gate_up_proj [experts, hidden, 2 x ffn]
                                    as [gate | up] halves, down_proj [experts, ffn, hidden] (FusedExperts
                                    FUSED_HALVES_X_AT_W, read and written per expert); shared_expert an
                                    ungated MLP of intermediate_size, added (megatron-core's SharedExpertMLP)
  feed_forward (Llama4TextMLP)      the other layers: a dense MLP of intermediate_size_mlp
  norms, embeddings, head           RMSNorm (rms_norm_eps), untied head unless tie_word_embeddings

The router's logits are computed in the model's dtype by HF and in float32 by megatron-core's sigmoid router
(moe_router_dtype fp32, as the sigmoid families set it): the same in fp32; HF's router_jitter_noise is never read
by Llama4TextMoe (nothing to map).
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.errors import ConversionError
from toolkit.families.experts import ATTENTION_ROWS, DENSE_LAYER_ROWS, expert_rows, shared_expert_rows
from toolkit.families.llama import L
from toolkit.families.router import Router, positive
from toolkit.families.table import FUSED_HALVES_X_AT_W, CustomLayer, Family, FusedExperts

FF = L + "feed_forward."
MOE_ROWS = (expert_rows(FF + "router.weight", FF + "experts.#.gate_proj.weight", FF + "experts.#.up_proj.weight",
                        FF + "experts.#.down_proj.weight")
            + shared_expert_rows(FF + "shared_expert.gate_proj.weight", FF + "shared_expert.up_proj.weight",
                                 FF + "shared_expert.down_proj.weight"))
# The dense layers' MLP under feed_forward.*, of width intermediate_size_mlp (Family.ffn_key)
DENSE_ROWS = tuple(replace(r, hf=tuple(n.replace(L + "mlp.", FF) for n in r.hf)) for r in DENSE_LAYER_ROWS)
LAYER_TYPES = ("full_attention", "chunked_attention")


def moe_layers(cfg: dict) -> str:
    """Per layer "1" for a Llama4TextMoe, "0" for a dense Llama4TextMLP (Llama4TextConfig's moe_layers)."""
    layers, moe = positive(cfg, "num_hidden_layers"), cfg.get("moe_layers")
    if not isinstance(moe, list) or any(type(i) is not int or not 0 <= i < layers for i in moe) or not moe:
        raise ConversionError(f"llama4 with moe_layers={moe!r}: needs a non-empty list of layer indices below "
                              f"num_hidden_layers={layers}")
    return "".join("1" if i in moe else "0" for i in range(layers))


def read_routing(cfg: dict) -> dict:
    """MoeFields of Llama4Router: sigmoid of the top-1 logit, applied to the expert's input, no bias."""
    topk = positive(cfg, "num_experts_per_tok")
    if topk != 1:
        raise ConversionError(f"llama4 with num_experts_per_tok={topk} cannot be mapped exactly to megatron-core: HF "
                              "scales each chosen expert's input by its own sigmoid, megatron-core's "
                              "moe_apply_probs_on_input only at top-1")
    return dict(score_function="sigmoid", expert_bias=False, renormalise=False,
                shared_ffn_hidden_size=positive(cfg, "intermediate_size"))


def read(cfg: dict) -> dict:
    """NoPE layers, the L2 q/k norm, and the longest sequence that is exact (chunks, temperature)."""
    layers, flags = int(cfg["num_hidden_layers"]), cfg["no_rope_layers"]
    if not isinstance(flags, list) or len(flags) < layers:
        raise ConversionError(f"llama4 with no_rope_layers={flags!r}: needs one entry per layer ({layers})")
    for i, flag in enumerate(flags[:layers]):
        if flag not in (0, 1) or isinstance(flag, bool):
            raise ConversionError(f"llama4 with no_rope_layers[{i}]={flag!r} cannot be mapped exactly to "
                                  "megatron-core (1: RoPE, 0: NoPE)")
    nope = "".join("0" if flag else "1" for flag in flags[:layers])
    types = cfg["layer_types"]
    bounds = []
    chunk = cfg.get("attention_chunk_size")
    if chunk is not None and "chunked_attention" in types[:layers]:
        if type(chunk) is not int or chunk < 1:
            raise ConversionError(f"llama4 with attention_chunk_size={chunk!r}: needs a positive integer")
        bounds.append(chunk)  # one chunk: plain causal attention
    scale = cfg.get("attn_scale")
    if cfg.get("attn_temperature_tuning") and "1" in nope and scale:
        floor = cfg.get("floor_scale")
        if type(floor) is not int or floor < 2:
            raise ConversionError(f"llama4 with floor_scale={floor!r}: its attention temperature needs an integer >= 2")
        bounds.append(floor - 1)  # log1p(floor((position + 1) / floor_scale)) is 0 below position floor_scale - 1
    return {"nope_layers": nope if "1" in nope else None, "qk_l2_norm": bool(cfg.get("use_qk_norm")),
            "exact_seq_len": min(bounds) if bounds else None}


LLAMA4 = Family(
    name="llama4",
    model_types=("llama4_text",),
    architecture="Llama4ForCausalLM",
    rows=ATTENTION_ROWS + MOE_ROWS + DENSE_ROWS,
    refuse_flags=("attention_bias",),
    accepted={"layer_types": LAYER_TYPES},
    rope_types=("default", "llama3"),
    ffn_key="intermediate_size_mlp",
    megatron={"rotary_interleaved": True, "moe_apply_probs_on_input": True},
    router=Router(experts_keys=("num_local_experts",), ffn_key="intermediate_size", layers=moe_layers,
                  read=read_routing),
    read=read,
    layer=CustomLayer(qk_norm="l2_rope"),
    fused_experts=FusedExperts(prefix=FF + "experts.", per_expert=FF + "experts.#.", gate_up="gate_up_proj",
                               down="down_proj", layout=FUSED_HALVES_X_AT_W, peft_reads_transposed=True),
)
