"""ModelSpec: the architecture facts megatron-core needs, read from an HF config.json.

The readers see the config as transformers' own config class resolves it (hf_values.py): a key
the file leaves out has the class's default, so there are no defaults of ours here.

Reading is strict: anything we cannot reproduce exactly in megatron-core (a rope-scaling type, a
bias, an activation, a partial rotary factor where the family's HF model has none) is refused with
a message, never approximated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from toolkit.errors import ConversionError
from toolkit.families.longrope import check_factor_counts, read_longrope
from toolkit.families.yarn import read_yarn
from toolkit.families.router import read_moe
from toolkit.families.table import Family

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling takes only `factor` from GPTModel; the
# other llama3 parameters are its hard-coded defaults (rotary_pos_embedding.py:92-99).
MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Why a rope type no family accepts cannot be expressed in megatron-core 0.16.1, where the reason
# is known (read from its source); added to the refusal. (LongRoPE, once here, is toolkit/blocks/rope_longrope.py.)
MCORE_ROPE_GAPS: dict[str, str] = {}


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float | None  # None: no RoPE on any layer (Family.nope_without_theta)
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_scaling_factor: float | None  # llama3-type scaling, None when unscaled
    window_size: int | None  # sliding window in tokens (HF semantics: attends to this many, itself included)
    dtype: str  # torch dtype name of the checkpoint, e.g. "bfloat16"
    # Mixture-of-Experts (0 experts: a dense model): routed experts, experts per token, one
    # expert's FFN width, whether the top-k probabilities are renormalised (toolkit/families/router.py)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalise: bool = False
    # A shared expert every token goes through, of this FFN width (0: none), scaled by a sigmoid gate
    # of its own where moe_shared_expert_gate (Qwen2-MoE's shared_expert_gate)
    moe_shared_ffn_hidden_size: int = 0
    moe_shared_expert_gate: bool = False
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss coefficient (toolkit/megatron_settings.py)
    # Per layer "1" for a MoE layer, "0" for a dense MLP of ffn_hidden_size (megatron-core's
    # moe_layer_freq as a list); None: every layer alike
    moe_layers: str | None = None
    # The router's score (megatron-core's moe_router_score_function): "softmax", or "sigmoid" (DeepSeek-V3,
    # GLM-4.5: always renormalised over the k kept), with an expert bias used for selection only
    # (HF e_score_correction_bias), group-limited top-k (None: no groups) and a scaling of the k
    # weights (None: 1) (toolkit/families/sigmoid_router.py)
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_num_groups: int | None = None
    moe_group_topk: int | None = None
    moe_scaling_factor: float | None = None
    # Per-head q/k RMSNorms where config.json decides (GLM-4.5's use_qk_norm; Qwen3 always has them)
    qk_norm: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0
    # Share of each head's dimensions RoPE rotates (HF partial_rotary_factor, megatron-core
    # rotary_percent); the rest pass through unrotated.
    rotary_percent: float = 1.0
    activation: str = "silu"  # of the gated MLP, in HF's name
    # Per layer, "1" where the window applies, "0" for full attention (Gemma 3's local / global
    # layers); None: the window, if any, applies to every layer
    window_layers: str | None = None
    window_rope_theta: float | None = None  # RoPE base of the windowed layers where it differs (Gemma 3)
    # Per layer, "1" for a layer without RoPE (SmolLM3's NoPE layers, megatron-core's no_rope_freq as a
    # list), "0" for one with it; None: RoPE on every layer
    nope_layers: str | None = None
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim)
    rope_linear_factor: float | None = None  # linear RoPE scaling (positions / factor), None when unscaled
    # LongRoPE (toolkit/blocks/rope_longrope.py): short_factor, long_factor, original_max_position_embeddings,
    # attention_factor; None without
    longrope: dict | None = field(default=None, hash=False)
    # gpt-oss (toolkit/families/gpt_oss.py): a learnable sink logit per head in every softmax
    # (megatron-core softmax_type='learnable'); biases on o_proj, the router and the experts
    # (add_bias_linear); the experts' SwiGLU clamped at glu_clamp with (up + glu_offset); YaRN RoPE
    # as megatron-core's `yarn_*` config attributes (None: no YaRN)
    attention_sinks: bool = False
    linear_bias: bool = False
    glu_clamp: float | None = None
    glu_offset: float = 0.0
    yarn: dict | None = field(default=None, hash=False)
    # Multi-latent attention (toolkit/families/mla.py): q_lora_rank (None: a full q_proj), kv_lora_rank,
    # qk_nope_head_dim, qk_rope_head_dim, v_head_dim; None: the usual attention
    mla: dict | None = field(default=None, hash=False)
    # DeepSeek Sparse Attention's lightning indexer on every multi-latent attention layer (toolkit/families/dsa.py):
    # heads, head_dim, topk; None: dense attention
    dsa: dict | None = field(default=None, hash=False)
    # Qwen3-Next (toolkit/families/qwen3_next.py): the gated delta net's sizes (k_heads, v_heads, k_dim,
    # v_dim, conv_kernel; None: no linear attention) and per layer "1" for a gated delta net layer, "0"
    # for an attention layer (megatron-core's linear_attention_freq as a list)
    linear_attention: dict | None = field(default=None, hash=False)
    linear_layers: str | None = None
    # Gemma 4 (toolkit/families/gemma4.py): its global layers' head_dim, kv_heads, k_eq_v (values are the
    # keys), rope_theta and partial_rotary_factor (proportional RoPE), the sliding layers' rope_theta; None without
    global_attention: dict | None = field(default=None, hash=False)
    # tanh soft-capping of the final logits: cap * tanh(logits / cap) (Gemma 2 / 4); None without
    final_logit_softcapping: float | None = None
    # The longest sequence the model converts and trains exactly as HF computes it (Mistral 4: its Llama-4
    # query scale is 1 below rope_parameters.original_max_position_embeddings, toolkit/families/mistral4.py);
    # None: no such bound
    exact_seq_len: int | None = None
    # Llama 4's use_qk_norm: a weightless L2 (RMS) norm of each query and key head on the layers with RoPE
    # (megatron-core's L2Norm, toolkit/blocks/decoder_spec.py; toolkit/families/llama4.py)
    qk_l2_norm: bool = False
    # Nemotron-H (toolkit/families/nemotron_h.py): Mamba-2's sizes (heads, head_dim, groups, state, conv_kernel,
    # chunk_size), the model megatron-core's HybridModel; None: no Mamba layers. Its layer pattern is
    # linear_layers, one symbol of megatron-core's per layer ("M" Mamba-2, "*" attention, "-" MLP)
    mamba: dict | None = field(default=None, hash=False)

    @property
    def hybrid_pattern(self) -> str | None:
        """megatron-core's hybrid layer pattern (HybridModel's hybrid_layer_pattern), None for a GPTModel."""
        return self.linear_layers if self.mamba else None

    def _mamba_sizes(self) -> dict:
        if not self.mamba:
            return {}
        m = self.mamba
        inner, bc = m["heads"] * m["head_dim"], m["groups"] * m["state"]
        return {"mamba_in_proj": 2 * inner + 2 * bc + m["heads"], "mamba_conv": inner + 2 * bc, "mamba_inner": inner,
                "mamba_heads": m["heads"], "mamba_kernel": m["conv_kernel"]}

    @property
    def q_lora(self) -> bool:
        """Multi-latent attention with a low-rank query (q_a_proj, q_a_layernorm, q_b_proj)."""
        return bool(self.mla) and self.mla["q_lora_rank"] is not None

    @property
    def q_full(self) -> bool:
        """Multi-latent attention with a full-rank query (q_proj)."""
        return bool(self.mla) and self.mla["q_lora_rank"] is None

    @property
    def required_layer_spec(self) -> tuple[str, str] | None:
        """(layer spec, why) where the model converts and runs on one of megatron-core's layer specs only;
        None where either does. The converter's default and the recipe's choice both come from here."""
        if self.mla:  # toolkit/families/mla.py: the TE spec's layout (gpt_layer_specs.py:232-268) is not written
            return "local", "multi-latent attention converts for megatron-core's local spec only"
        if self.mamba:  # toolkit/blocks/hybrid_spec.py: local modules on every device
            return "local", "a hybrid model runs on the toolkit's local hybrid stack spec only"
        return None

    def _mla_sizes(self) -> dict:
        if not self.mla:
            return {}
        m, heads = self.mla, self.num_heads
        return {"q_lora": m["q_lora_rank"] or 0, "kv_lora": m["kv_lora_rank"],
                "kv_down": m["kv_lora_rank"] + m["qk_rope_head_dim"],
                "q_heads": heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]),
                "kv_up": heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), "v_size": heads * m["v_head_dim"]}

    def _dsa_sizes(self) -> dict:
        if not self.dsa:
            return {}
        d = self.dsa
        return {"index_q": d["heads"] * d["head_dim"], "index_dim": d["head_dim"], "index_heads": d["heads"]}

    @property
    def is_dense(self) -> bool:
        return not self.is_moe

    @property
    def global_k_eq_v(self) -> bool:
        """Gemma 4's global layers take their values from the key projection (no v_proj)."""
        return bool(self.global_attention) and self.global_attention["k_eq_v"]

    @property
    def global_own_v(self) -> bool:
        """Gemma 4's global layers with a v_proj of their own."""
        return bool(self.global_attention) and not self.global_attention["k_eq_v"]

    def _global_sizes(self) -> dict:
        if not self.global_attention:
            return {}
        g = self.global_attention
        return {"g_head_dim": g["head_dim"], "g_q_size": self.num_heads * g["head_dim"],
                "g_kv_size": g["kv_heads"] * g["head_dim"]}

    def _linear_sizes(self) -> dict:
        if not self.linear_attention:
            return {}
        la = self.linear_attention
        qk, v = la["k_heads"] * la["k_dim"], la["v_heads"] * la["v_dim"]
        return {"gated_q_size": 2 * self.num_heads * self.head_dim, "gdn_qkvz": 2 * qk + 2 * v,
                "gdn_ba": 2 * la["v_heads"], "gdn_conv": 2 * qk + v, "gdn_qkv": 2 * qk + v, "gdn_kernel": la["conv_kernel"],
                "gdn_v_heads": la["v_heads"], "gdn_v_dim": la["v_dim"], "gdn_v_size": v, "gdn_k_size": qk}

    def size_of(self, symbol: str) -> int:
        return {
            "hidden": self.hidden_size,
            "ffn": self.ffn_hidden_size,
            "vocab": self.vocab_size,
            "q_size": self.num_heads * self.head_dim,
            "kv_size": self.num_kv_heads * self.head_dim,
            "head_dim": self.head_dim,
            "heads": self.num_heads,
            "qkv_size": (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
            "2ffn": 2 * self.ffn_hidden_size,
            "experts": self.num_experts,
            "moe_ffn": self.moe_ffn_hidden_size,
            "2moe_ffn": 2 * self.moe_ffn_hidden_size,
            "shared_ffn": self.moe_shared_ffn_hidden_size,
            "one": 1,
            **self._mla_sizes(),
            **self._dsa_sizes(),
            **self._linear_sizes(),
            **self._global_sizes(),
            **self._mamba_sizes(),
        }[symbol]

    def expert_tp(self, tp: int) -> int:
        """Expert tensor parallelism at TP `tp`: TP (megatron-core's default), or 1 where the experts
        have biases, which megatron-core supports only there (transformer_config.py:1588)."""
        return 1 if self.is_moe and self.linear_bias else tp

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates: one pair per frequency of
        arange(0, int(head_dim * rotary_percent), 2), in HF and in megatron-core alike."""
        return 2 * -(-int(self.head_dim * self.rotary_percent) // 2)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**d)


def _require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ConversionError(f"config.json has no '{key}', which this model family needs")
    return cfg[key]


def _count(cfg: dict, key: str) -> int:
    """A size the model is built from (layers, heads, widths): a whole number of at least 1, else
    one line here rather than a ZeroDivisionError or an empty model later."""
    value = int(_require(cfg, key))
    if value < 1:
        raise ConversionError(f"config.json has {key}={cfg[key]!r}: it must be at least 1")
    return value


def _rope(cfg: dict, family: Family) -> dict:
    """rope_theta, the llama3 factor and the linear factor, as ModelSpec fields. transformers 5
    writes `rope_parameters` (theta inside, one dict per layer type for some families), and its
    config classes turn older checkpoints' top-level `rope_theta` and `rope_scaling` into it."""
    params = dict(_require(cfg, "rope_parameters"))
    source, field = _rope_names(cfg)
    if family.rope_key and isinstance(params.get(family.rope_key), dict):
        source, params = f"{source}.{family.rope_key}", dict(params[family.rope_key])
    if params.get("rope_theta") is None and family.nope_without_theta:
        return {"rope_theta": None}
    theta = _require(params, "rope_theta")  # transformers 5 always puts it there
    rope_type = params.get("rope_type", "default")
    if rope_type not in family.rope_types:
        why = f": {MCORE_ROPE_GAPS[rope_type]}" if rope_type in MCORE_ROPE_GAPS else ""
        raise ConversionError(
            f"{source}.{field}={rope_type!r}: rope scaling type '{rope_type}' is not supported for {family.name} "
            f"(supported: {', '.join(family.rope_types)}); refusing to convert approximately{why}"
        )
    if rope_type == "default":
        return {"rope_theta": float(theta)}
    if rope_type == "proportional":  # Gemma 4's global layers: the family reads the rest (toolkit/families/gemma4.py)
        return {"rope_theta": float(theta)}
    if rope_type == "linear":
        return {"rope_theta": float(theta), "rope_linear_factor": _linear_factor(params, source)}
    if rope_type == "longrope":
        return {"rope_theta": float(theta), "longrope": read_longrope(cfg, params, source)}
    if rope_type == "yarn":
        return {"rope_theta": float(theta), "yarn": read_yarn(cfg, params, source)}
    for key, fixed in MCORE_LLAMA3_FIXED.items():
        if float(params.get(key, fixed)) != fixed:
            raise ConversionError(
                f"llama3 rope scaling with {key}={params.get(key)} is not supported: megatron-core "
                f"0.16.1 hard-codes {key}={fixed} (only `factor` is configurable)"
            )
    return {"rope_theta": float(theta), "rope_scaling_factor": float(_require(params, "factor"))}


def _rope_names(cfg: dict) -> tuple[str, str]:
    """The key and field naming the rope type as the file writes them, for a refusal to name what
    the user sees (a transformers 4 file: rope_scaling.type)."""
    in_file = getattr(cfg, "in_file", cfg)
    scaling = in_file.get("rope_scaling")
    if in_file.get("rope_parameters") or not isinstance(scaling, dict):
        return "rope_parameters", "rope_type"
    return "rope_scaling", "rope_type" if "rope_type" in scaling else "type"


def _linear_factor(params: dict, source: str) -> float:
    """megatron-core divides positions by the factor (rotary_pos_embedding.py:142), HF divides the
    frequencies: the same angles bit for bit only when dividing is exact, for a power of two."""
    factor = float(_require(params, "factor"))
    if factor < 1 or math.frexp(factor)[0] != 0.5:
        raise ConversionError(f"{source}.factor={factor!r}: linear rope scaling is exact in megatron-core only for "
                              "a power-of-two factor (it scales positions, HF scales frequencies)")
    return factor


def _refuse_unmappable(cfg: dict, family: Family) -> None:
    for flag in family.refuse_flags:
        if cfg.get(flag):
            raise ConversionError(f"{family.name} with {flag}={cfg[flag]!r} cannot be mapped exactly to megatron-core")
    for key, allowed in family.accepted.items():
        value = cfg.get(key)
        entries = enumerate(value) if isinstance(value, list) else [(None, value)] if value is not None else []
        for i, v in entries:
            if v not in allowed:
                where = key if i is None else f"{key}[{i}]"
                raise ConversionError(f"{family.name} with {where}={v!r} cannot be mapped exactly to megatron-core "
                                      f"(accepted: {', '.join(map(repr, allowed))})")


def read_spec(cfg: dict, family: Family) -> ModelSpec:
    _refuse_unmappable(cfg, family)
    act_key, act_expected = family.activation
    act = _require(cfg, act_key)
    if act != act_expected:
        raise ConversionError(f"{act_key}={act!r} is not supported for {family.name} (only a gated MLP with {act_expected})")
    hidden = _count(cfg, "hidden_size")
    heads = _count(cfg, "num_attention_heads")
    window = cfg.get(family.window_key) if family.window_key else None
    moe = read_moe(cfg, family.name, family.router) if family.router and family.router.applies(cfg) else None
    own = family.read(cfg) if family.read else {}
    # what a family reads itself (Nemotron-H: its layer count from layers_block_type, layer_norm_epsilon, no RoPE)
    fields = {"rope_scaling_factor": None, **({} if "rope_theta" in own else _rope(cfg, family)), **own}
    spec = ModelSpec(
        family=family.name,
        num_layers=fields.pop("num_layers") if "num_layers" in fields else _count(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=_count(cfg, family.ffn_key),
        num_heads=heads,
        num_kv_heads=_count(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=_count(cfg, "vocab_size"),
        norm_eps=fields.pop("norm_eps") if "norm_eps" in fields else float(_require(cfg, "rms_norm_eps")),
        max_position_embeddings=int(_require(cfg, "max_position_embeddings")),
        tied_embeddings=bool(_require(cfg, "tie_word_embeddings")),
        qkv_bias=family.qkv_bias if isinstance(family.qkv_bias, bool) else bool(_require(cfg, family.qkv_bias)),
        window_size=int(window) if window else None,
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        **({} if moe is None else moe.spec_fields()),
        rotary_percent=_rotary_percent(cfg, family),
        activation=act,
        **fields,
    )
    if spec.longrope:
        check_factor_counts(spec.longrope, spec.rotary_dim)
    return spec


def _rotary_percent(cfg: dict, family: Family) -> float:
    """HF's partial_rotary_factor: in rope_parameters (transformers 5), else at the top level, as
    the HF config classes read it."""
    rope_params = cfg.get("rope_parameters") or {}
    partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if family.mla_rope_share:  # the MLA head's rotated share, which qk_pos_emb_head_dim already is
        nope, rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        if partial is not None and isinstance(nope, int) and isinstance(rope, int) and float(partial) != rope / (nope + rope):
            raise ConversionError(f"partial_rotary_factor={partial!r} is not supported for {family.name}: its RoPE rotates "
                                  f"the qk_rope_head_dim={rope} of each {nope + rope}-dimensional head (only {rope / (nope + rope)!r})")
        return 1.0
    if partial is None or float(partial) == 1.0:
        return 1.0
    if not family.partial_rotary:
        raise ConversionError(f"partial_rotary_factor={partial!r} is not supported for {family.name} (only 1.0)")
    if not 0.0 < float(partial) < 1.0:
        raise ConversionError(f"partial_rotary_factor={partial!r} is not supported (only a share in (0, 1])")
    return float(partial)
