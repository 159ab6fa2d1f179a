"""Fill a config's "auto" values the way the HF Trainer and Accelerate do, with their own code.

`check --hf-trainer` judges a config by what DeepSpeed receives after this fill, so that what it
refuses is exactly what fails in the Trainer / Accelerate pipeline, not a hand-written list:

1. transformers' HfTrainerDeepSpeedConfig.trainer_config_process (TrainingArguments values:
   batch, clipping, optimizer, warmup LR, precision), as TrainingArguments.__post_init__ runs it;
2. Accelerate's DeepSpeedPlugin (ZeRO stage, offload, 16-bit save) and set_mixed_precision, as
   the Accelerator state runs them;
3. trainer_config_finalize (hidden-size buckets, total and warmup steps), as deepspeed_init runs it;
4. Accelerate's fill_match on every "auto" still left: Accelerator.prepare raises on each
   ("... not found in kwargs"), so each one is an error naming its key.

The TrainingArguments are the ones a user of this config would pass: its concrete values (batch,
LR, betas, clipping, precision) and defaults elsewhere, so that a mismatch the Trainer reports is
a contradiction inside the config itself.
"""

from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import dataclass, field

# Only size the buckets and steps the fill writes; any positive values give the same verdict.
REPRESENTATIVE_HIDDEN_SIZE = 4096  # Llama-3-8B
REPRESENTATIVE_TRAINING_STEPS = 1000

AUTO = "auto"


@dataclass
class Filled:
    config: dict | None  # None when Accelerate refuses the config before filling it
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, path, message)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def fill(config: dict, world_size: int = 1, hidden_size: int = REPRESENTATIVE_HIDDEN_SIZE,
         steps: int = REPRESENTATIVE_TRAINING_STEPS) -> Filled:
    """A filled copy of `config` and what the Trainer / Accelerate refuse in it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    result = Filled(copy.deepcopy(config))
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref  # HfDeepSpeedConfig() replaces the process-wide one
    try:
        _run_fill(result, world_size, hidden_size, steps)
    except (AttributeError, TypeError) as e:  # a block of the wrong type (the type pass names it)
        result.problems.append(("hf-fill", "", f"the HF Trainer / Accelerate fill crashes on this config "
                                f"({type(e).__name__}: {_first_line(e)})"))
        result.config = None
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
    result.notes.append(f"\"auto\" filled by the HF Trainer and Accelerate's own code for {world_size} process(es), "
                        f"hidden size {hidden_size}, {steps} training steps")
    return result


def _run_fill(result: Filled, world_size: int, hidden_size: int, steps: int) -> None:
    """The four steps of the module docstring, in the order the Trainer runs them."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    user_steps_per_print = result.config.get("steps_per_print")
    args = trainer_arguments(result.config, world_size)
    hf = HfTrainerDeepSpeedConfig(result.config)
    hf.trainer_config_process(args)
    plugin = _accelerate_plugin(hf, args, result)
    if plugin is None:
        return
    _finalize(hf, args, hidden_size, steps, result)
    _leftover_autos(plugin, hf.config, result)
    result.config = hf.config
    _restore_steps_per_print(result.config, user_steps_per_print)


def _accelerate_plugin(hf, args, result: Filled):
    from accelerate.utils import DeepSpeedPlugin

    try:
        plugin = DeepSpeedPlugin(hf_ds_config=hf)
        plugin.set_mixed_precision(args.mixed_precision)
    except ValueError as e:
        result.problems.append(("hf-fill", "", f"Accelerate refuses this config: {_first_line(e)}"))
        result.config = None
        return None
    return plugin


def _finalize(hf, args, hidden_size: int, steps: int, result: Filled) -> None:
    try:
        hf.trainer_config_finalize(args, _ModelStub(hidden_size), steps)
    except ValueError as e:  # raised for the mismatches it collected, one per line
        if not hf.mismatches:
            result.problems.append(("hf-fill", "", f"the HF Trainer refuses this config: {_first_line(e)}"))
        for line in hf.mismatches:
            key = line.removeprefix("- ds ").split("=", 1)[0]
            result.problems.append(("hf-mismatch", key, f"the HF Trainer refuses it: {line.removeprefix('- ')}"))


def _leftover_autos(plugin, config: dict, result: Filled) -> None:
    for path in _autos(config):
        try:
            plugin.fill_match(path, must_match=False)
        except ValueError:
            result.problems.append(("auto-value", path, "neither the HF Trainer nor Accelerate fills this \"auto\" "
                                    "(Accelerate's prepare() raises 'not found in kwargs'); write a value"))


def trainer_arguments(config: dict, world_size: int):
    """TrainingArguments matching the config's concrete values, for a cluster of `world_size`."""
    from transformers import TrainingArguments

    class ClusterArguments(TrainingArguments):
        @property
        def world_size(self) -> int:  # this process is one; the config is for the cluster
            return world_size

    optimizer = _dict(_dict(config, "optimizer"), "params")
    scheduler = _dict(_dict(config, "scheduler"), "params")
    values = {
        "gradient_accumulation_steps": _number(config.get("gradient_accumulation_steps"), integer=True),
        "learning_rate": _first_number(optimizer.get("lr"), scheduler.get("warmup_max_lr")),
        "adam_epsilon": _number(optimizer.get("eps")),
        "weight_decay": _number(optimizer.get("weight_decay")),
        "max_grad_norm": _number(config.get("gradient_clipping")),
        "fp16": _dict(config, "fp16").get("enabled") is True,
        "bf16": (_dict(config, "bf16") or _dict(config, "bfloat16")).get("enabled") is True,
    }
    betas = optimizer.get("betas")
    if isinstance(betas, list) and len(betas) == 2:
        values.update(adam_beta1=betas[0], adam_beta2=betas[1])
    values["per_device_train_batch_size"] = _micro_batch(config, world_size, values["gradient_accumulation_steps"])
    values = {k: v for k, v in values.items() if v is not None}
    return ClusterArguments(output_dir=tempfile.gettempdir(), report_to=[], use_cpu=True, **values)


def _micro_batch(config: dict, world_size: int, accumulation: int | None) -> int | None:
    micro = _number(config.get("train_micro_batch_size_per_gpu"), integer=True)
    total = _number(config.get("train_batch_size"), integer=True)
    if micro is None and total is not None:
        micro = max(1, total // (world_size * (accumulation or 1)))
    return micro


class _ModelStub:
    """What trainer_config_finalize reads of the model: config.hidden_size."""

    def __init__(self, hidden_size: int):
        self.config = type("Config", (), {"hidden_size": hidden_size})()


def _autos(node, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in _autos(value, f"{path}.{key}" if path else key)]
    return [path] if node == AUTO else []


def _restore_steps_per_print(config: dict, value) -> None:
    """Accelerate sets steps_per_print to inf to silence DeepSpeed; judge the user's value."""
    if value is None:
        config.pop("steps_per_print", None)
    else:
        config["steps_per_print"] = value


def _dict(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _number(value, integer: bool = False):
    """A finite JSON number (an integral one if `integer`), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if integer:
        return int(value) if float(value).is_integer() else None
    return value


def _first_number(*values):
    return next((v for v in map(_number, values) if v is not None), None)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
