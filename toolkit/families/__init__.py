"""Model families: one file each in this package, looked up by config.json's `model_type`.

A family is whatever `Family` a module of this package defines at its top level, so adding one
is adding its file: nothing else lists them.
"""

from __future__ import annotations

import importlib
import pkgutil

from toolkit.errors import ConversionError
from toolkit.families.hf_values import ConfigReading, config_values
from toolkit.families.spec import ModelSpec, read_spec
from toolkit.families.table import Family, Row, float32_buffer_suffixes


def _declared_families() -> tuple[Family, ...]:
    """Every Family defined in a module of this package (modules in name order)."""
    found: dict[str, Family] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        found.update((f.name, f) for f in vars(module).values() if isinstance(f, Family))
    return tuple(found.values())


FAMILIES: tuple[Family, ...] = _declared_families()
# Name suffixes of the float32 buffers the tables declare: megatron-core's (".mlp.router.expert_bias") and
# HF's (".mlp.gate.e_score_correction_bias")
BUFFERS, HF_FLOAT32_BUFFERS = float32_buffer_suffixes(FAMILIES)

# model_types that name a known model this package cannot convert, with the reason. (The multimodal
# Gemma 3, once here, converts as its language model: toolkit/convert/wrapper.py.)
REFUSED: dict[str, str] = {
    # (Ministral 3, once here, converts exactly up to original_max_position_embeddings: toolkit/families/ministral3.py;
    # Llama 4 likewise up to its bound: toolkit/families/llama4.py)
}


def family_for(model_type: str | None) -> Family:
    if model_type in REFUSED:
        raise ConversionError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ConversionError(f"model_type {model_type!r} is not supported (supported: {supported})")


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConversionError(f"unknown family {name!r}")


def spec_from_config(cfg: dict, source: str = "config.json") -> tuple[Family, ModelSpec]:
    family, spec, _ = read_config(cfg, source)
    return family, spec


def read_config(cfg: dict, source: str = "config.json") -> tuple[Family, ModelSpec, ConfigReading]:
    """Family and ModelSpec of a config.json read through transformers' config class (every key
    the file leaves out at that class's default), and which keys were read or defaulted."""
    family = family_for(cfg.get("model_type"))
    values = config_values(cfg, source, family.config_class_of.get(cfg.get("model_type")))
    return family, read_spec(values, family), values.reading()


__all__ = ["BUFFERS", "FAMILIES", "HF_FLOAT32_BUFFERS", "ConfigReading", "Family", "ModelSpec", "Row", "family_for", "family_named", "read_config",
           "spec_from_config"]
