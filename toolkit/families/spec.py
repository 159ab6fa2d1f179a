"""ModelSpec: the architecture facts megatron-core needs, read from an HF config.json.

Reading is strict: anything we cannot reproduce exactly in megatron-core (a rope-scaling type, a
bias, an activation, a partial rotary factor) is refused with a message, never approximated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from toolkit.errors import ConversionError
from toolkit.families.router import read_moe
from toolkit.families.table import Family

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling takes only `factor` from GPTModel; the
# other llama3 parameters are its hard-coded defaults (rotary_pos_embedding.py:92-99).
MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
    rope_theta: float
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def size_of(self, symbol: str) -> int:
        return {
            "hidden": self.hidden_size,
            "ffn": self.ffn_hidden_size,
            "vocab": self.vocab_size,
            "q_size": self.num_heads * self.head_dim,
            "kv_size": self.num_kv_heads * self.head_dim,
            "head_dim": self.head_dim,
            "qkv_size": (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
            "2ffn": 2 * self.ffn_hidden_size,
            "experts": self.num_experts,
            "moe_ffn": self.moe_ffn_hidden_size,
            "2moe_ffn": 2 * self.moe_ffn_hidden_size,
        }[symbol]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**d)


def _require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ConversionError(f"config.json has no '{key}', which this model family needs")
    return cfg[key]


def _rope(cfg: dict, family: Family) -> tuple[float, float | None]:
    """(rope_theta, llama3 factor or None). transformers 5 writes `rope_parameters` (theta
    inside); older checkpoints have top-level `rope_theta` and `rope_scaling`."""
    source = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = dict(cfg.get(source) or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    field = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(field, "default")
    if rope_type not in family.rope_types:
        raise ConversionError(
            f"{source}.{field}={rope_type!r}: rope scaling type '{rope_type}' is not supported for {family.name} "
            f"(supported: {', '.join(family.rope_types)}); refusing to convert approximately"
        )
    if rope_type == "default":
        return float(theta), None
    for key, fixed in MCORE_LLAMA3_FIXED.items():
        if float(params.get(key, fixed)) != fixed:
            raise ConversionError(
                f"llama3 rope scaling with {key}={params.get(key)} is not supported: megatron-core "
                f"0.16.1 hard-codes {key}={fixed} (only `factor` is configurable)"
            )
    return float(theta), float(_require(params, "factor"))


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
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"hidden_act={act!r} is not supported (only SwiGLU with silu)")
    rope_params = cfg.get("rope_parameters") or {}  # transformers 5 keeps the factor there
    partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ConversionError(f"partial_rotary_factor={partial!r} is not supported (only 1.0)")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    theta, factor = _rope(cfg, family)
    window = cfg.get(family.window_key) if family.window_key else None
    moe = read_moe(cfg, family.name, family.router) if family.router else None
    return ModelSpec(
        family=family.name,
        num_layers=int(_require(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_require(cfg, "intermediate_size")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(_require(cfg, "vocab_size")),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(_require(cfg, "max_position_embeddings")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias,
        rope_scaling_factor=factor,
        window_size=int(window) if window else None,
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        **({} if moe is None else dict(num_experts=moe.num_experts, moe_topk=moe.topk,
                                       moe_ffn_hidden_size=moe.ffn_hidden_size, moe_renormalise=moe.renormalise)),
    )
