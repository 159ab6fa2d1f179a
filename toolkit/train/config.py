"""Fine-tuning configuration: a typed dataclass tree, loaded from a recipe YAML and overridden
from the command line with dotted keys (`optim.lr=1e-4 parallel.tp=2`)."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ConfigError


@dataclass
class ModelConfig:
    checkpoint: str = ""  # a directory written by `toolkit convert hf-to-megatron` (either format)
    # Optional expectations: a checkpoint of another architecture is refused before training.
    family: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    zero_stage: int = 1  # 1, 2 or 3; only 1 with PP > 1
    recompute: str | None = None  # None, "selective" or "full" (megatron-core granularity)


@dataclass
class DataConfig:
    train_file: str = ""
    valid_file: str | None = None
    seq_len: int = 128
    pack: bool = False  # concatenate samples, with attention reset at document boundaries
    overlong: str = "truncate"  # "truncate" or "drop" samples longer than seq_len + 1 tokens
    malformed: str = "error"  # "error" or "skip" malformed JSONL lines (skips are counted)
    shuffle: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0  # never applied to norms and biases
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"  # "cosine" or "constant" after the linear warmup
    clip_grad: float = 1.0


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "toolkit-finetune"
    run_id: str | None = None  # stable id => a restarted job continues the same run
    mode: str | None = None  # e.g. "offline"; WANDB_MODE from the environment wins


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    precision: str = "bf16"  # "bf16" or "fp32"; fp16 is refused (loss scaling not proven with the PP schedule)
    micro_batch: int = 1
    global_batch: int = 8
    steps: int = 100
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end (when a validation set is given)
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    run_dir: str = "runs/finetune"
    resume: str = "none"  # "none", "auto" (latest complete checkpoint in run_dir) or a checkpoint path
    export_hf: bool = True
    peak_tflops: float | None = None  # per device; looked up for known GPUs, nominal on CPU

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value, hint):
    """Turn a YAML/CLI value into the dataclass field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None or hint is typing.Any:
        return value
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value in ("none", "None", "null"):
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option)
            except (ValueError, TypeError, ConfigError):
                continue
        raise ConfigError(f"cannot read {value!r} as {hint}")
    if origin is tuple:
        items = json.loads(value) if isinstance(value, str) else value
        return tuple(_coerce(v, a) for v, a in zip(items, args))
    if hint is bool:
        if isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ConfigError(f"expected true/false, got {value!r}")
        return bool(value)
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"expected a number, got {value!r}")
        return hint(float(value)) if hint is int and isinstance(value, str) and "e" in value.lower() else hint(value)
    if hint is str:
        return str(value)
    raise ConfigError(f"unsupported type {hint}")


def _apply(obj, key_path: list[str], value, full_key: str) -> None:
    hints = typing.get_type_hints(type(obj))
    name = key_path[0]
    if name not in hints:
        known = ", ".join(hints)
        raise ConfigError(f"unknown config key {full_key!r} (known at this level: {known})")
    if len(key_path) > 1:
        child = getattr(obj, name)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"{full_key!r}: {name} has no sub-keys")
        _apply(child, key_path[1:], value, full_key)
        return
    if dataclasses.is_dataclass(getattr(obj, name)):
        if not isinstance(value, dict):
            raise ConfigError(f"{full_key!r} is a section; give its keys")
        for k, v in value.items():
            _apply(getattr(obj, name), [k], v, f"{full_key}.{k}")
        return
    try:
        setattr(obj, name, _coerce(value, hints[name]))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{full_key}={value!r}: {e}") from None


def _is_text_field(cfg, keys: list[str]) -> bool:
    """String fields take command-line text verbatim (a value like `a: b` is not YAML for them)."""
    obj = cfg
    for name in keys[:-1]:
        obj = getattr(obj, name, None)
        if not dataclasses.is_dataclass(obj):
            return False
    hint = typing.get_type_hints(type(obj)).get(keys[-1])
    return hint is str or (hint is not None and set(typing.get_args(hint)) == {str, type(None)})


def _parse_value(text: str):
    """A command-line value as YAML (numbers, lists, true/false), or the plain string when it isn't YAML."""
    import yaml

    if not text:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the recipe YAML, then `key.sub=value` overrides."""
    import yaml

    cfg = TrainConfig()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {path} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {path} must be a mapping of config keys")
        for key, value in data.items():
            _apply(cfg, [key], value, key)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        keys = key.split(".")
        _apply(cfg, keys, value if _is_text_field(cfg, keys) else _parse_value(value), key)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Checks that need no model or processes; layout checks happen once the world size is known."""
    if cfg.precision not in ("bf16", "fp32"):
        hint = " (fp16 is refused: DeepSpeed scales the loss only inside engine.backward, which the "
        hint += "megatron-core pipeline schedule does not call)" if cfg.precision == "fp16" else ""
        raise ConfigError(f"precision must be bf16 or fp32{hint}")
    if cfg.parallel.pp > 1 and cfg.parallel.zero_stage > 1:
        raise ConfigError("ZeRO-2/3 do not work with pipeline parallelism (several micro-batches in flight); use zero_stage=1")
    if cfg.parallel.zero_stage not in (1, 2, 3):
        raise ConfigError(
            "zero_stage must be 1, 2 or 3: at ZeRO-0 DeepSpeed refuses the direct backward calls of "
            "megatron-core's schedule (and reports no gradient norm); ZeRO-1 costs nothing extra at DP=1"
        )
    if cfg.parallel.recompute not in (None, "selective", "full"):
        raise ConfigError("parallel.recompute must be selective, full or none")
    if cfg.data.overlong not in ("truncate", "drop") or cfg.data.malformed not in ("error", "skip"):
        raise ConfigError("data.overlong must be truncate|drop and data.malformed error|skip")
    if cfg.optim.schedule not in ("cosine", "constant"):
        raise ConfigError("optim.schedule must be cosine or constant")
    if min(cfg.micro_batch, cfg.global_batch, cfg.steps, cfg.data.seq_len) < 1:
        raise ConfigError("micro_batch, global_batch, steps and data.seq_len must be >= 1")
    if not cfg.model.checkpoint:
        raise ConfigError("model.checkpoint is required (a directory from `toolkit convert hf-to-megatron`)")
    if not cfg.data.train_file:
        raise ConfigError("data.train_file is required")
