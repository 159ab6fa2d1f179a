"""The shape of a model family: a table of mapping rows plus the few config facts that differ.

A row pairs one megatron-core tensor (canonical Transformer Engine / dist-checkpoint name, `*`
standing for the layer index, `#` for the expert index of a Mixture-of-Experts layer) with the HF
tensor(s) it is built from and how it splits across tensor-parallel ranks. Adding a family means
writing a table, not new control flow. Expert rows use megatron-core's local numbering on an
expert-parallel rank (`local_experts.#`); the converter maps it to the global HF expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from toolkit.families.router import Router
from toolkit.splits.kinds import SplitKind

EXPERT = "#"


@dataclass(frozen=True)
class Row:
    megatron: str
    hf: tuple[str, ...]
    split: SplitKind
    # Expected HF shapes, in symbols resolved from the model spec (see ModelSpec.size_of).
    shapes: tuple[tuple[str, ...], ...]
    # The kind of decoder layer the row belongs to where a model mixes kinds (MOE_LAYER, DENSE_LAYER:
    # a dense MLP among Mixture-of-Experts layers); None: every layer
    kind: str | None = None
    # A ModelSpec flag the row depends on where the config decides whether the tensor exists
    # (GLM-4.5's attention_bias, use_qk_norm); None: always there
    when: str | None = None
    # megatron-core's torch_dist key where it is not the canonical name (the local MLA spec keys its
    # norms by their own modules: toolkit/families/mla.py); None: the canonical name
    dist: str | None = None
    # A buffer, not a parameter, that HF and megatron-core both keep in float32 whatever the weights'
    # dtype (the sigmoid router's expert bias: HF's _keep_in_fp32_modules_strict, megatron-core's
    # _maintain_float32_expert_bias): converted, loaded and exported as stored, never trained by the optimizer
    float32_buffer: bool = False
    # A parameter some transformers release keeps in float32 whatever the weights' dtype (the sigmoid router's
    # weight: _keep_in_fp32_modules_strict lists `gate.weight` from transformers 5.24, not in 5.23), so a
    # checkpoint may store it in either: converted and exported as stored (toolkit/families/float32.py)
    float32_parameter: bool = False
    # The kind of token mixer the row belongs to where a model mixes them (LINEAR_ATTENTION: Qwen3-Next's
    # gated delta net layers, FULL_ATTENTION: its attention layers; MAMBA_LAYER, MLP_LAYER: a hybrid model's
    # Mamba-2 and MLP-only layers); None: every layer
    attention: str | None = None

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    def on_layer(self, layer: int, moe_layers: str | None, linear_layers: str | None = None) -> bool:
        """Whether layer `layer` holds this row's tensor; `moe_layers`, `linear_layers` as ModelSpec's."""
        return ((self.kind is None or self.kind == layer_kind(moe_layers, layer))
                and (self.attention is None or self.attention == attention_kind(linear_layers, layer)))

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.megatron

    @property
    def kept_in_float32(self) -> bool:
        """A tensor transformers keeps in float32 among weights of another dtype (in some release)."""
        return self.float32_buffer or self.float32_parameter

    @property
    def is_buffer(self) -> bool:
        """A megatron-core buffer, saved with the model but not a parameter (the router's expert bias)."""
        return self.float32_buffer

    def megatron_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return _fill(self.megatron, layer, expert)

    def dist_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return _fill(self.dist or self.megatron, layer, expert)

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        return tuple(_fill(n, layer, expert) for n in self.hf)


def _fill(pattern: str, layer: int | None, expert: int | None) -> str:
    if layer is not None:
        pattern = pattern.replace("*", str(layer))
    return pattern if expert is None else pattern.replace(EXPERT, str(expert))


def row(megatron: str, hf: str | tuple[str, ...], split: SplitKind, *shapes: tuple[str, ...], kind: str | None = None,
        when: str | None = None, dist: str | None = None, float32_buffer: bool = False,
        attention: str | None = None, float32_parameter: bool = False) -> Row:
    return Row(megatron, (hf,) if isinstance(hf, str) else hf, split, shapes, kind, when, dist, float32_buffer,
               float32_parameter, attention)


def _after_layer(name: str) -> str:
    return name.rsplit("*", 1)[-1]


def float32_buffer_suffixes(families) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(megatron-core, HF) name suffixes, after the layer index, of the float32 buffers `families`' tables
    declare (Row.float32_buffer): what the loader and the training checkpoint keep in float32."""
    rows = [r for f in families for r in f.rows if r.float32_buffer]
    return (tuple(sorted({_after_layer(r.megatron) for r in rows})),
            tuple(sorted({_after_layer(n) for r in rows for n in r.hf})))


MOE_LAYER, DENSE_LAYER = "moe", "dense"


def layer_kind(moe_layers: str | None, layer: int) -> str:
    """`moe_layers`: per layer "1" for a Mixture-of-Experts layer, "0" for a dense one (megatron-core's
    moe_layer_freq as a list); None: every layer alike (all MoE in a MoE model, rows of kind
    MOE_LAYER being the only layer-kind rows a model without dense layers has)."""
    return DENSE_LAYER if moe_layers is not None and moe_layers[layer] == "0" else MOE_LAYER


LINEAR_ATTENTION, FULL_ATTENTION, GLOBAL_ATTENTION = "linear", "full", "global"
# ModelSpec.linear_layers' letter for an attention layer with head sizes of its own (Gemma 4's global layers)
GLOBAL_LAYER = "2"
# ModelSpec.linear_layers' letter for a sparse attention layer without an indexer of its own, which reuses an earlier
# layer's top-k (GLM-5's IndexShare: toolkit/families/glm_moe_dsa.py), and its kind
SHARED_INDEX_LAYER, SHARED_INDEX_ATTENTION = "3", "shared_index"


# A hybrid model's layers (Nemotron-H: megatron-core's HybridModel), by their symbol in its layer pattern, which
# is ModelSpec.linear_layers there: a Mamba-2 layer, an attention-only layer, an MLP-only layer, a Mixture-of-Experts
# layer alone (Nemotron 3's E)
MAMBA_LAYER, MLP_LAYER, EXPERTS_LAYER = "mamba", "mlp", "experts"
HYBRID_SYMBOLS = {"M": MAMBA_LAYER, "*": FULL_ATTENTION, "-": MLP_LAYER, "E": EXPERTS_LAYER}


def attention_kind(linear_layers: str | None, layer: int) -> str:
    """`linear_layers`: per layer "1" for a gated delta net (linear attention) layer, "0" for attention
    (megatron-core's linear_attention_freq as a list), "2" for an attention layer with head sizes of its
    own (Gemma 4's global layers beside its sliding "0" ones: toolkit/families/gemma4.py), "3" for a sparse
    attention layer reusing an earlier layer's top-k (GLM-5's shared indexers), or a hybrid
    model's pattern symbol (HYBRID_SYMBOLS: Nemotron-H); None: attention everywhere."""
    kind = linear_layers[layer] if linear_layers is not None else "0"
    if kind in HYBRID_SYMBOLS:
        return HYBRID_SYMBOLS[kind]
    return {"1": LINEAR_ATTENTION, GLOBAL_LAYER: GLOBAL_ATTENTION, SHARED_INDEX_LAYER: SHARED_INDEX_ATTENTION}.get(kind, FULL_ATTENTION)


OUTPUT_LAYER = "output_layer.weight"


@dataclass(frozen=True)
class CustomLayer:
    """A decoder layer megatron-core's stock GPT spec cannot express, as choices the toolkit's own
    block spec (toolkit/blocks/decoder_spec.py) composes from megatron-core modules. Megatron-Bridge builds
    Gemma 3 the same way: a custom layer spec, the rest of GPTModel unchanged."""

    pre_norms: bool = True  # a norm before attention and before the MLP (input_layernorm, pre_mlp_layernorm)
    post_norms: bool = False  # a norm on the attention output and on the MLP output, before the residual add
    # "head": one RMSNorm per head on q and k (megatron-core's qk_layernorm); "projection": one
    # RMSNorm over the whole q and the whole k projection, all heads (across TP ranks) together; "l2_rope":
    # megatron-core's weightless L2Norm per head on the layers with RoPE, where ModelSpec.qk_l2_norm (Llama 4)
    qk_norm: str | None = None
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden), cast to the weight dtype as HF does
    # Gemma 4: global layers (ModelSpec.linear_layers "2") with their own head size, KV heads and RoPE,
    # keys as values there where attention_k_eq_v, a scale-free RMSNorm on the values, the layer's output
    # times its stored layer_scalar (toolkit/blocks/attention_self.py Gemma4SelfAttention,
    # toolkit/blocks/decoder_spec.py ScaledTransformerLayer)
    gemma4: bool = False
    # The choices of a gated delta net (linear attention) layer where they differ from the attention layers'
    # (OLMo-Hybrid: norms before its token mixer and MLP, after them on its attention layers); None: the same
    linear_layer: "CustomLayer | None" = None


# FusedExperts.layout: how a layer's fused gate_up and down tensors hold each expert's weights
# gpt-oss (GptOssExperts, x @ W): gate_up [experts, hidden, 2 x ffn], gate and up interleaved on the last
# dimension (gate = [..., 0::2], up = [..., 1::2]); down [experts, ffn, hidden]
FUSED_INTERLEAVED = "interleaved"
# transformers 5's MoE experts (Qwen3_5MoeExperts, nn.functional.linear): gate_up [experts, 2 x ffn, hidden],
# gate and up as halves (`.chunk(2, dim=-1)` of the output: gate = rows [:ffn], up = rows [ffn:]);
# down [experts, hidden, ffn]
FUSED_HALVES = "halves"
# Llama 4 (Llama4TextExperts, torch.bmm(x, W)): gate_up [experts, hidden, 2 x ffn], gate and up as halves of the
# last dimension (`gate_up.chunk(2, dim=-1)`: gate = [..., :ffn], up = [..., ffn:]); down [experts, ffn, hidden]
FUSED_HALVES_X_AT_W = "halves_x_at_w"
FUSED_LAYOUTS = (FUSED_INTERLEAVED, FUSED_HALVES, FUSED_HALVES_X_AT_W)


@dataclass(frozen=True)
class FusedExperts:
    """HF tensors holding every expert of a layer at once: `gate_up` and `down` laid out as `layout` says
    (FUSED_INTERLEAVED, as gpt-oss stores them; FUSED_HALVES, as transformers 5's Qwen3_5MoeExperts holds
    them; FUSED_HALVES_X_AT_W, as Llama4TextExperts does), with biases where the family has them ([experts, 2 x ffn], gate and up as the weight's, and
    [experts, hidden]). With `mxfp4`, the weights may be MXFP4: `<name>_blocks` [experts, out, in / 32, 16]
    and `<name>_scales` [experts, out, in / 32] (toolkit/convert/fused_experts.py). The family's rows
    name each expert's tensors under `per_expert` (`*` the layer, `#` the expert) as gate_proj / up_proj /
    down_proj `.weight` ([out, in], as nn.Linear) and `.bias`. Where a checkpoint holds per-expert tensors
    instead, nothing is fused and they are read as stored."""

    prefix: str  # of the fused tensors, `*` for the layer: transformers' experts module (PEFT's target_parameters)
    per_expert: str
    gate_up: str
    down: str
    gate_up_bias: str | None = None
    down_bias: str | None = None
    layout: str = FUSED_INTERLEAVED
    mxfp4: bool = False  # the weights may be stored in MXFP4 (gpt-oss as published)
    # The export writes the experts fused (gpt-oss: transformers reads no other form), or per expert as
    # transformers' own save_pretrained writes them (Qwen3.5-MoE: its conversion mapping reversed)
    export_fused: bool = True
    # Each fused tensor read transposed unless its shape already is the module's ([experts, 2 x ffn, hidden] /
    # [experts, hidden, ffn], the config's hidden_size and moe_intermediate_size), as transformers'
    # Transpose(check_dims=True) reads them (Qwen3-VL-MoE: published x @ W, its own save nn.Linear's)
    either_orientation: bool = False
    # transformers' module applies the weights as x @ W but does not say so (no `is_transposed`: Llama4TextExperts):
    # PEFT's ParamWrapper (target_parameters) then reads [experts, in, out] as [experts, out, in], and its lora_A
    # faces the output, lora_B the input (toolkit/lora/experts.py)
    peft_reads_transposed: bool = False

    def __post_init__(self):
        if self.layout not in FUSED_LAYOUTS:
            raise ValueError(f"FusedExperts.layout={self.layout!r}: expected one of {FUSED_LAYOUTS}")
        if (self.gate_up_bias is None) != (self.down_bias is None):
            raise ValueError("FusedExperts: both biases or neither")

    @property
    def biases(self) -> bool:
        return self.gate_up_bias is not None

    @property
    def interleaved(self) -> bool:
        """Gate and up alternate in gate_up (gate at the even places); else [gate; up] halves."""
        return self.layout == FUSED_INTERLEAVED

    @property
    def transposed(self) -> bool:
        """Weights stored [in, out] (applied as x @ W: gpt-oss, Llama 4); else [out, in] as nn.Linear."""
        return self.layout in (FUSED_INTERLEAVED, FUSED_HALVES_X_AT_W)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architecture: str  # the HF class written into config.json "architectures"
    rows: tuple[Row, ...]
    # q/k/v biases: always, never, or as the config.json key of that name says (GLM-4.5's attention_bias)
    qkv_bias: bool | str = False
    # config.json key holding a sliding-window size that applies to every layer, if any
    window_key: str | None = None
    # config.json flags this family can't map exactly: refuse if any is truthy
    refuse_flags: tuple[str, ...] = ()
    rope_types: tuple[str, ...] = ("default",)
    # The HF model rotates only the first int(head_dim * partial_rotary_factor) dimensions of each
    # head and passes the rest through, as megatron-core does with rotary_percent (rope_utils.py:113)
    partial_rotary: bool = False
    # config.json keys with the only values this family maps exactly (for a list, every element):
    # any other value is refused, naming the key and the value
    accepted: dict[str, tuple] = field(default_factory=dict, hash=False)
    # megatron-core TransformerConfig fields this family sets beyond the shared ones (toolkit/
    # megatron_settings.py), as a Megatron-Bridge provider does per family: e.g. qk_layernorm
    megatron: dict[str, object] = field(default_factory=dict, hash=False)
    # Mixture-of-Experts: where config.json holds the experts and how tokens are routed (None: dense)
    router: Router | None = None
    # config.json key of the dense MLP's width; an all-MoE family whose config class has none (Qwen3.5-MoE
    # deletes intermediate_size) names its experts' width, which then sizes no layer
    ffn_key: str = "intermediate_size"
    # config.json key naming the MLP activation, and the only value accepted
    activation: tuple[str, str] = ("hidden_act", "silu")
    # Where rope_parameters holds one dict per layer type: the key of the full-attention layers' dict
    rope_key: str | None = None
    # Family-specific config.json facts as ModelSpec fields (cfg -> dict), refusing what can't be exact
    read: Callable[[dict], dict] | None = field(default=None, hash=False)
    # The decoder layer, where megatron-core's stock GPT layer cannot express it
    layer: CustomLayer | None = None
    # config.json key counting the multi-token-prediction layers stored after the decoder layers
    # (`model.layers.<num_hidden_layers + i>.*`, GLM-4.5 / DeepSeek-V3), which HF's model ignores on
    # load: the converter leaves them out and says so
    mtp_key: str | None = None
    # Where the multi-token-prediction layers are stored under a prefix of their own instead (Qwen3-Next's
    # `mtp.*`, which HF's model ignores on load: `_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`)
    mtp_prefix: str | None = None
    # (stored prefix, module prefix) where HF's model names its modules otherwise than its files name the tensors
    # (Nemotron-H: backbone.* stored, model.* in transformers 5.24's module, which PEFT names an adapter's weights by)
    module_prefix: tuple[str, str] | None = None
    # model_type -> the one of transformers' config classes that reads it, where transformers has none of
    # its own (Kimi-K2's "kimi_k2", whose auto_map names DeepSeek's DeepseekV3Config)
    config_class_of: dict[str, str] = field(default_factory=dict, hash=False)
    # Experts stored fused per layer (gpt-oss; Qwen3.5-MoE where a checkpoint holds them so), read per expert by
    # the converter
    fused_experts: FusedExperts | None = None
    # HF's partial_rotary_factor is the share of a multi-latent attention head that RoPE rotates,
    # qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim) (Mistral 4), which megatron-core's
    # qk_pos_emb_head_dim already is: read as that share (rotary_percent 1), any other value refused
    mla_rope_share: bool = False
    # PEFT target names PEFT's LoRA refuses on this family's HF model -> why, as a refusal names it (Nemotron-H: PEFT
    # refuses out_proj and conv1d on Mamba-based models); the toolkit refuses them too, and all-linear where it takes one
    peft_refused: dict[str, str] = field(default_factory=dict, hash=False)
    # rope_parameters.rope_theta null means no RoPE on any layer (OLMo-Hybrid as published: OlmoHybridModel
    # builds no rotary embedding then, megatron-core's position_embedding_type 'none'); else it is required
    nope_without_theta: bool = False

    @property
    def float32_names(self) -> tuple[tuple[str, str], ...]:
        """(megatron-core, HF) name suffixes, after the layer index, of each tensor transformers keeps in
        float32 (Row.kept_in_float32): converted and exported as stored (toolkit/families/float32.py)."""
        return tuple(sorted({(_after_layer(r.megatron), _after_layer(r.hf[0])) for r in self.rows if r.kept_in_float32}))

    @property
    def hf_float32(self) -> tuple[str, ...]:
        """The HF name suffixes of float32_names."""
        return tuple(hf for _, hf in self.float32_names)

    def rows_for(self, spec) -> tuple[Row, ...]:
        """The rows of `spec` (a ModelSpec): with tied embeddings the output layer is the embedding,
        so its row is dropped; a row that depends on a flag (Row.when) only where the flag is set."""
        return tuple(r for r in self.rows if not (spec.tied_embeddings and r.megatron == OUTPUT_LAYER)
                     and (r.when is None or getattr(spec, r.when)))
