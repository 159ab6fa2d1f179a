"""Model families: one declarative table each, looked up by config.json's `model_type`."""

from __future__ import annotations

from toolkit.errors import ConversionError
from toolkit.families.llama import LLAMA
from toolkit.families.mistral import MISTRAL
from toolkit.families.qwen2 import QWEN2
from toolkit.families.spec import ModelSpec, read_spec
from toolkit.families.table import Family, Row

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2)


def family_for(model_type: str | None) -> Family:
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


def spec_from_config(cfg: dict) -> tuple[Family, ModelSpec]:
    family = family_for(cfg.get("model_type"))
    return family, read_spec(cfg, family)


__all__ = ["FAMILIES", "Family", "ModelSpec", "Row", "family_for", "family_named", "spec_from_config"]
