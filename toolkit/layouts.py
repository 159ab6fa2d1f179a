"""A tensor x pipeline layout of a model: which layers live on which stage, the padded vocab,
and the divisibility rules megatron-core imposes."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import ConversionError
from toolkit.families.spec import ModelSpec
from toolkit.splits.kinds import Geometry

# Megatron-LM's default: pad the vocab to a multiple of 128 * TP (arguments.py).
DEFAULT_VOCAB_DIVISOR = 128


# How messages call the layout sizes: the CLI's flags (convert, ds-config, memory) or the recipe's keys.
CLI_NAMES = {"tp": "--tp {}", "pp": "--pp {}", "ep": "--ep {}"}
RECIPE_NAMES = {"tp": "parallel.tp={}", "pp": "parallel.pp={}", "ep": "parallel.ep={}"}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vocab_divisor: int = DEFAULT_VOCAB_DIVISOR
    # expert parallelism: each EP rank holds num_experts / ep experts, split over TP as well
    # (megatron-core's expert tensor parallel size defaults to TP)
    ep: int = 1

    def padded_vocab(self, vocab_size: int) -> int:
        multiple = self.vocab_divisor * self.tp
        return -(-vocab_size // multiple) * multiple

    def stage_layers(self, spec: ModelSpec, stage: int) -> range:
        per_stage = spec.num_layers // self.pp
        return range(stage * per_stage, (stage + 1) * per_stage)

    def geometry(self, spec: ModelSpec) -> Geometry:
        return Geometry(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
            padded_vocab_size=self.padded_vocab(spec.vocab_size),
            **({"linear_k_heads": spec.linear_attention["k_heads"], "linear_v_heads": spec.linear_attention["v_heads"],
                "linear_k_dim": spec.linear_attention["k_dim"], "linear_v_dim": spec.linear_attention["v_dim"]}
               if spec.linear_attention else {}),
            **({"global_kv_heads": spec.global_attention["kv_heads"], "global_head_dim": spec.global_attention["head_dim"]}
               if spec.global_attention else {}),
            **({"mamba_heads": spec.mamba["heads"], "mamba_head_dim": spec.mamba["head_dim"],
                "mamba_groups": spec.mamba["groups"], "mamba_state": spec.mamba["state"]} if spec.mamba else {}),
        )

    def local_experts(self, spec: ModelSpec, ep_rank: int) -> range:
        """Global indices of the experts EP rank `ep_rank` holds (megatron-core's
        MoELayer.local_expert_indices), numbered 0.. on the rank."""
        per_rank = spec.num_experts // self.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def rank_dir(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
        """Megatron-LM's per-rank directory name (checkpointing.py get_checkpoint_name): the expert
        rank is appended as _EEE when EP > 1."""
        name = f"mp_rank_{tp_rank:02d}" if self.pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        return name if self.ep == 1 else f"{name}_{ep_rank:03d}"

    def check(self, spec: ModelSpec, names: dict[str, str] = CLI_NAMES) -> None:
        """Refuse layouts megatron-core cannot build for this model; `names` says how the message
        calls each size (the CLI's flags, or the recipe's keys: RECIPE_NAMES)."""
        tp, pp = names["tp"].format(self.tp), names["pp"].format(self.pp)
        if self.tp < 1 or self.pp < 1:
            raise ConversionError(f"{tp} and {pp}: both must be >= 1")
        if self.vocab_divisor < 1:
            raise ConversionError("--vocab-divisor must be >= 1")
        if spec.num_layers % self.pp:
            raise ConversionError(
                f"{spec.num_layers} layers cannot be split evenly over {pp} "
                "(uneven pipeline stages are not supported)"
            )
        if spec.num_heads % self.tp:
            raise ConversionError(f"{spec.num_heads} attention heads are not divisible by {tp}")
        groups = spec.num_kv_heads
        if groups % self.tp and self.tp % groups:
            raise ConversionError(
                f"{groups} key/value heads and {tp}: neither divides the other, which "
                "megatron-core cannot shard"
            )
        g_groups = (spec.global_attention or {}).get("kv_heads", 0)  # Gemma 4's global layers
        if g_groups and g_groups % self.tp and (self.tp % g_groups or spec.global_k_eq_v):
            why = ("the keys that are also values (attention_k_eq_v) need whole key heads on each rank"
                   if spec.global_k_eq_v and not self.tp % g_groups else "neither divides the other, which megatron-core "
                   "cannot shard")
            raise ConversionError(f"{g_groups} global key/value heads (num_global_key_value_heads) and {tp}: {why}")
        # megatron-core splits a gated delta net by whole key heads, each with the value heads it serves
        # (transformer_config.py:975-980; value heads are a multiple of key heads, qwen3_next.read)
        k_heads = (spec.linear_attention or {}).get("k_heads", 0)
        if k_heads % self.tp:
            raise ConversionError(f"{k_heads} linear-attention key heads (linear_num_key_heads) are not divisible "
                                  f"by {tp}: megatron-core splits the gated delta net by whole key heads")
        # megatron-core splits a Mamba-2 mixer by whole heads and whole B/C groups (mamba_mixer.py:260, :268)
        for key, size in (("mamba_num_heads", "heads"), ("n_groups", "groups")) if spec.mamba else ():
            if spec.mamba[size] % self.tp:
                raise ConversionError(f"{key} {spec.mamba[size]} is not divisible by {tp}: megatron-core splits the "
                                      "Mamba-2 mixer by whole heads and B/C groups")
        if spec.ffn_hidden_size % self.tp:
            raise ConversionError(f"intermediate_size {spec.ffn_hidden_size} is not divisible by {tp}")
        for key, size in self._mla_down_projections(spec):
            if size % self.tp:
                raise ConversionError(f"{key} {size} is not divisible by {tp} (megatron-core's local multi-latent "
                                      "attention splits its down projection's rows over TP)")
        self._check_experts(spec, names)

    @staticmethod
    def _mla_down_projections(spec: ModelSpec) -> list[tuple[str, int]]:
        if not spec.mla:
            return []
        kv = ("kv_lora_rank + qk_rope_head_dim", spec.size_of("kv_down"))
        return [("q_lora_rank", spec.size_of("q_lora")), kv] if spec.q_lora else [kv]

    def _check_experts(self, spec: ModelSpec, names: dict[str, str]) -> None:
        tp, ep = names["tp"].format(self.tp), names["ep"].format(self.ep)
        if self.ep < 1:
            raise ConversionError(f"{ep}: must be >= 1")
        if self.ep > 1 and not spec.is_moe:
            raise ConversionError(f"{ep} needs a Mixture-of-Experts model; {spec.family} has no experts")
        if spec.num_experts % self.ep:
            raise ConversionError(f"{spec.num_experts} experts cannot be split evenly over {ep}")
        if spec.moe_ffn_hidden_size % spec.expert_tp(self.tp):
            raise ConversionError(f"the experts' FFN width {spec.moe_ffn_hidden_size} is not divisible by {tp} "
                                  "(expert tensor parallelism is the TP size where the experts have no biases)")
        if spec.moe_shared_ffn_hidden_size % self.tp:
            raise ConversionError(f"the shared expert's FFN width {spec.moe_shared_ffn_hidden_size} is not divisible "
                                  f"by {tp}")
