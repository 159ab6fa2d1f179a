"""config.json's values as transformers reads them: every key the file leaves out takes the
default of the family's own config class (Gemma3TextConfig, Phi3Config...), never one of ours.

The family readers (spec.py, router.py, a family's `read`) look keys up in a `ConfigValues`:
the config class's `to_dict()` after building it from the file, so a missing `rope_theta`,
`tie_word_embeddings` or `num_key_value_heads` is whatever the HF model would use. It records
which keys the readers looked at, so `toolkit convert hf-to-megatron --verbose` can say which
were read from the file and which were set by transformers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from toolkit.errors import ConversionError


# Sizes a model is built from: a whole number of at least 1 each (spec.py checks the resolved values too).
SIZE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size")


class ConfigValues(dict):
    """The resolved config (a dict, so the readers index it as the file), remembering the keys
    looked up and those present in the file itself."""

    def __init__(self, resolved: dict, in_file: dict, class_name: str):
        super().__init__(resolved)
        self.in_file = in_file
        self.class_name = class_name
        self.looked_up: list[str] = []

    def _note(self, key) -> None:
        if key not in self.looked_up:
            self.looked_up.append(key)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._note(key)
        return super().__contains__(key)

    def reading(self) -> "ConfigReading":
        looked = [k for k in self.looked_up if isinstance(k, str)]
        return ConfigReading(
            class_name=self.class_name,
            read={k: self.in_file[k] for k in looked if k in self.in_file},
            defaults={k: dict.get(self, k) for k in looked if k not in self.in_file and dict.__contains__(self, k)},
        )


@dataclass(frozen=True)
class ConfigReading:
    """Which config.json keys a conversion read, and the values transformers' class gave the
    keys the file leaves out (a default, or derived from other keys, as rope_parameters from a
    top-level rope_theta)."""

    class_name: str
    read: dict
    defaults: dict

    def lines(self) -> list[str]:
        out = [f"config.json read through transformers' {self.class_name}:",
               f"  read from the file ({len(self.read)}): {', '.join(sorted(self.read)) or 'none'}"]
        if not self.defaults:
            return out + ["  defaults applied: none"]
        out.append(f"  not in the file, set by {self.class_name} ({len(self.defaults)}):")
        return out + [f"    {k} = {self.defaults[k]!r}" for k in sorted(self.defaults)]


def config_values(cfg: dict, source: str = "config.json", model_type: str | None = None) -> ConfigValues:
    """Build transformers' config class for cfg['model_type'] (or `model_type`'s, Family.config_class_of)
    from the dict (its type checks included: a refusal there is a ConversionError naming `source`) and
    return its values."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    config_class = CONFIG_MAPPING[model_type or cfg["model_type"]]
    for key in SIZE_KEYS:  # before the class divides by them (a ZeroDivisionError there names no key)
        value = cfg.get(key)
        if type(value) is int and value < 1:
            raise ConversionError(f"{source} has {key}={value!r}: it must be at least 1")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its warnings about token ids are not ours to show
    try:
        # save_pretrained writes inf as {"__float__": "Infinity"} (NemotronHConfig's time_step_limit), which
        # from_pretrained decodes on reading the file (_dict_from_json_file), from_dict does not
        decode = getattr(config_class, "_decode_special_floats", lambda values: values)
        resolved = config_class.from_dict(decode(copy.deepcopy(cfg))).to_dict()  # it edits nested dicts in place
    except Exception as e:  # huggingface_hub's StrictDataclassError, ValueError, TypeError: all refusals
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ConversionError(f"{source} is refused by transformers' {config_class.__name__}: {detail}") from e
    finally:
        logging.set_verbosity(verbosity)
    return ConfigValues(resolved, cfg, config_class.__name__)


# model_type -> the class AutoModelForCausalLM should build where transformers' own mapping leaves it out:
# transformers 5.17-5.24 map mistral4 to Mistral4ForCausalLM for pre-training and image-text-to-text only, and
# mistral3 (Mistral Small 4's wrapper) to Mistral3ForConditionalGeneration likewise (modeling_auto.py)
CAUSAL_LM_GAPS = {"mistral4": ("Mistral4Config", "Mistral4ForCausalLM"),
                  "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
                  # Qwen3-VL's wrappers (their language models have no causal-LM class): the wrapper on text
                  "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
                  "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
                  # GLM-4.5V / GLM-4.6V / GLM-4.6V-Flash / GLM-4.1V's wrappers likewise
                  "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration"),
                  "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration"),
                  "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration"),
                  "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration")}  # (config class, model class)


def auto_causal_lm():
    """transformers.AutoModelForCausalLM, mapping the model types of CAUSAL_LM_GAPS to their classes where the
    installed release does not itself: added to the names its lazy mapping reads (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    the dict AutoModelForCausalLM's mapping holds), since AutoModelForCausalLM.register skips transformers' own
    config classes before 5.24 (auto_factory.py: `if key.__module__.startswith("transformers."): return`)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, (_, model_name) in CAUSAL_LM_GAPS.items():
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and hasattr(transformers, model_name):
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] = model_name
    return transformers.AutoModelForCausalLM


def positive_ints(cfg: dict, keys: dict[str, str]) -> dict[str, int]:
    """{name: cfg[key]} for `keys` (name -> config key), each refused in one line unless a positive integer
    (the gated delta net's sizes, toolkit/families/qwen3_next.py; Mamba-2's, nemotron_h.py)."""
    values = {}
    for name, key in keys.items():
        values[name] = cfg.get(key)
        if type(values[name]) is not int or values[name] < 1:
            raise ConversionError(f"config.json has {key}={values[name]!r}; expected a positive integer")
    return values
