"""Run DeepSpeed's own pydantic models over the blocks it validates, and explain what they reject.

Using DeepSpeed's models (not a copy of their fields) keeps `check` in agreement with DeepSpeed on
these blocks by construction. Imports DeepSpeed, so it is loaded only when a check runs.
"""

from __future__ import annotations

import typing

from toolkit.dsconfig.report import Report, as_number, did_you_mean, join

# pydantic error types for a number written as a string, or an integer written with a fraction
_PARSING = ("int_parsing", "float_parsing")
_FRACTION = "int_from_float"
_EXTRA = "extra_forbidden"


def models() -> dict[str, type]:
    """Config path -> the pydantic model DeepSpeed 0.19.8 builds from it."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
        "bfloat16": DeepSpeedBF16Config,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "comms_logger": CommsLoggerConfig,
        "compile": CompileConfig,
        "hybrid_engine": HybridEngineConfig,
        "tensor_parallel": TPTrainingConfig,
        "weight_quantization": WeightQuantConfig,
        "timers.throughput": DeepSpeedThroughputTimerConfig,
    }


def field_names(model, loc: tuple = ()) -> set[str]:
    """Field names and aliases accepted at `loc` inside `model` (following nested models)."""
    for part in loc:
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        nested = _nested_model(field.annotation) if field else None
        if nested is None:
            return set()
        model = nested
    return {name for name in model.model_fields} | {f.alias for f in model.model_fields.values() if f.alias}


def _nested_model(annotation):
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
            return candidate
    return None


def validate(path: str, block, model, report: Report) -> None:
    """Build `model` from `block` exactly as DeepSpeed does; translate what it rejects."""
    from pydantic import ValidationError

    if not isinstance(block, dict):
        report.add("wrong-type", path, f"expected an object, got {type(block).__name__} {block!r}")
        return
    try:
        model(**block)
    except ValidationError as e:
        for err in e.errors():
            _translate(path, model, err, report)
    except (AssertionError, ValueError, TypeError) as e:
        report.add("invalid-field", path, f"DeepSpeed rejects this block: {e}")


def _translate(path: str, model, err: dict, report: Report) -> None:
    loc = tuple(str(p) for p in err["loc"])
    where = join(path, ".".join(loc))
    value = err.get("input")
    kind = err["type"]
    if kind == _EXTRA:
        _extra_key(path, model, loc, report)
    elif kind in _PARSING and isinstance(value, str) and as_number(value) is not None:
        report.add("string-number", where,
                   f"{value!r} is a string; DeepSpeed's pydantic models need a JSON number here (write {as_number(value)})")
    elif kind == _FRACTION:
        report.add("fractional-integer", where,
                   f"{value!r} has a fractional part but must be an integer (write {int(value)}); this is the "
                   "HF 0.9*h*h bucket-size bug (DeepSpeed #6525)")
    else:
        message = err["msg"].removeprefix("Value error, ")
        report.add("invalid-field", where or path, f"{message} (got {value!r})")


def _extra_key(path: str, model, loc: tuple, report: Report) -> None:
    known = field_names(model, loc[:-1])
    key = loc[-1]
    where = join(path, ".".join(loc))
    hint = did_you_mean(key, known)
    if path in ("bf16", "bfloat16") and key in field_names(models()["fp16"]):
        report.add("fp16-key-under-bf16", where,
                   f"'{key}' is an fp16 loss-scaling setting; bf16 has no loss scaling (remove it)")
        return
    report.add("invalid-field", where, f"unknown key '{key}', which DeepSpeed rejects{hint}")
