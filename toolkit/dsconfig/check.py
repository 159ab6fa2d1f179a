"""`check`: validate any DeepSpeed JSON the way DeepSpeed does, and catch what it lets through.

With hf_trainer, the config is first filled by the HF Trainer's and Accelerate's own code
(hf_fill.py); what they refuse, and any "auto" they leave, is an error, and the passes below judge
the filled config, which is what DeepSpeed receives.

Three passes:
1. keys and types against what DeepSpeed reads (keys.py), including the plain-dict blocks whose
   typos DeepSpeed ignores, and "auto" values (only the HF Trainer / Accelerate fill them);
2. DeepSpeed's own pydantic models for the blocks it validates (pydantic_blocks.py);
3. cross-field rules: batch arithmetic for the data-parallel size, PP x ZeRO, precision,
   offload, optimizer and scheduler (semantics.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from toolkit.dsconfig import keys, pydantic_blocks, semantics
from toolkit.bounds import VALUE_BOUNDS
from toolkit.dsconfig.report import WARNING, Report, as_number, did_you_mean, join
from toolkit.errors import ConfigError


def check(config: dict | str | Path, gpus: int | None = None, tp: int = 1, pp: int = 1,
          hf_trainer: bool = False) -> Report:
    """Check a config (dict, or path to a JSON file) for a cluster of `gpus` GPUs in TP x PP."""
    report = Report()
    if not isinstance(config, dict):
        config = load(config, report)
        if config is None:
            return report
    if not isinstance(config, dict):
        report.add("wrong-type", "", "a DeepSpeed config must be a JSON object")
        return report
    _check_keys(config, report, check_autos=not hf_trainer)  # what the user wrote
    if hf_trainer:
        config = _hf_fill(config, report, _world_size(gpus, tp, pp))
        if config is None:
            return report
    _check_values(config, report)
    blocks = pydantic_blocks.models()
    for path, model in blocks.items():
        block = _get(config, path)
        if block is not None:
            pydantic_blocks.validate(path, block, model, report)
    semantics.check(config, report, gpus=gpus, tp=tp, pp=pp, hf_trainer=hf_trainer)
    return report


def load(path: str | Path, report: Report) -> dict | None:
    """Parse a JSON file; duplicate keys are reported (DeepSpeed raises on them)."""
    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                report.add("duplicate-key", key, "appears twice; DeepSpeed refuses files with duplicate keys")
            seen[key] = value
        return seen

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:  # DeepSpeed reads its config as UTF-8 JSON
        raise ConfigError(f"{path} is not valid UTF-8 (byte {e.start}): JSON config files are UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        report.add("invalid-json", "", f"{path} is not valid JSON: {e}")
        return None


def _get(config: dict, path: str):
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _hf_fill(config: dict, report: Report, world_size: int) -> dict | None:
    from toolkit.dsconfig.hf_fill import fill

    filled = fill(config, world_size)
    for kind, path, message in filled.problems:
        report.add(kind, path, message)
    report.notes.extend(filled.notes)
    return filled.config


def _world_size(gpus: int | None, tp: int, pp: int) -> int:
    """The HF Trainer runs one process per GPU, data parallel; without --gpus, one process."""
    return gpus // (tp * pp) if gpus and tp * pp and gpus % (tp * pp) == 0 else 1


def _check_keys(config: dict, report: Report, check_autos: bool) -> None:
    if check_autos:
        _check_autos(config, "", report)
    _check_table(config, "", keys.TOP_LEVEL, report, _sub_key_index())
    for block, table in keys.BLOCK_KEYS.items():
        if isinstance(config.get(block), dict):
            _check_table(config[block], block, table, report)
    for path, table in keys.NESTED_KEYS.items():
        node = _get(config, path)
        if isinstance(node, dict):
            _check_table(node, path, table, report)


def _check_table(node: dict, path: str, table: dict, report: Report, elsewhere: dict | None = None) -> None:
    for key, value in node.items():
        where = join(path, key)
        if key not in table:
            _unknown(key, where, path, table, report, elsewhere or {})
        elif value != "auto":
            _check_type(where, value, table[key], report)


def _unknown(key: str, where: str, path: str, table: dict, report: Report, elsewhere: dict) -> None:
    if not path and key in _removed_keys():
        report.add("removed-key", where, _removed_keys()[key])
        return
    if keys.is_comment(key):
        report.add("comment-key", where, "a comment by convention; DeepSpeed ignores it", WARNING)
        return
    hint = did_you_mean(key, table)
    if not hint and key in elsewhere:
        hint = f"; it belongs inside '{elsewhere[key]}'"
    kind = "unknown-key" if not path else "unknown-block-key"
    report.add(kind, where, f"DeepSpeed does not read '{key}' here and would silently ignore it{hint}")


def _check_values(config: dict, report: Report) -> None:
    """Learning rates, betas, clipping and step counts within their bounds (bounds.py)."""
    for path, bound in VALUE_BOUNDS.items():
        value = _get(config, path)
        if value is not None and not isinstance(value, str):  # strings: reported by the type pass
            _add(report, "out-of-range", path, bound.problem(path.rsplit(".", 1)[-1], value))


def _add(report: Report, kind: str, path: str, message: str | None) -> None:
    if message:
        report.add(kind, path, message)


def _check_type(where: str, value, expected, report: Report) -> None:
    if expected is keys.ANY or value is None:
        return
    if expected in (int, float) and isinstance(value, float) and not math.isfinite(value):
        kind = "integer" if expected is int else "number"
        report.add("non-finite", where, f"must be a finite {kind} (got {value!r})")
        return
    if isinstance(expected, tuple):
        if value not in expected:
            report.add("invalid-value", where, f"{value!r} is not one of {', '.join(map(str, expected))}")
        return
    if expected in (int, float) and isinstance(value, str) and as_number(value) is not None:
        report.add("string-number", where, f"{value!r} is a string; write the number {as_number(value)}")
    elif expected is int and isinstance(value, float) and not value.is_integer():
        report.add("fractional-integer", where, f"{value!r} must be an integer (write {int(value)})")
    elif not _has_type(value, expected):
        report.add("wrong-type", where, f"expected {expected.__name__}, got {type(value).__name__} {value!r}")


def _has_type(value, expected) -> bool:
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    if expected is int:
        return isinstance(value, int) or isinstance(value, float) and value.is_integer()
    return isinstance(value, expected)


def _check_autos(node, path: str, report: Report) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _check_autos(value, join(path, key), report)
    elif node == "auto":
        if "." in path and path.split(".")[0] in keys.VALIDATED_BLOCKS:
            why = "DeepSpeed silently drops it and uses its own default"
        else:
            why = "DeepSpeed keeps the string 'auto' and fails later"
        report.add("auto-value", path, f"'auto' is only filled in by the HF Trainer / Accelerate; {why}. "
                   "Write a value, or check with --hf-trainer if this file is for the HF Trainer")


def _sub_key_index() -> dict[str, str]:
    """Sub-key -> its block, to point a misplaced top-level key at the right block."""
    index = {key: block for block, table in keys.BLOCK_KEYS.items() for key in table}
    for path, model in pydantic_blocks.models().items():
        index.update({key: path for key in pydantic_blocks.field_names(model)})
    return index


def _removed_keys() -> dict[str, str]:
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    return _REMOVED_TOP_LEVEL_CONFIG_KEYS



__all__ = ["check", "load"]
