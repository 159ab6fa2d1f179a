"""config.json checked with transformers' own rules before we trust a number in it.

transformers 5 config classes are strict dataclasses: `num_hidden_layers: "4"` or
`tie_word_embeddings: "no"` is refused there, so it is refused here with the same words. The
layer count is first compared with the weights, because some config classes build per-layer
lists (Qwen2's layer_types) and a huge `num_hidden_layers` would take minutes there.
"""

from __future__ import annotations

import re
from pathlib import Path

from toolkit.errors import ConversionError
from toolkit.families import Family, ModelSpec, family_for, spec_from_config

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_layer_count(cfg: dict, tensor_names, path: Path, family: Family | None = None) -> None:
    """Refuse a num_hidden_layers that contradicts the layers present in the weights (which may hold
    the family's multi-token-prediction layers after them, Family.mtp_key)."""
    declared = cfg.get("num_hidden_layers")
    if type(declared) is not int:
        return  # a wrong type: validate_config reports it
    mtp = cfg.get(family.mtp_key) if family is not None and family.mtp_key else 0
    layers = {int(m.group(1)) for name in tensor_names if (m := _HF_LAYER.match(name))}
    held = max(layers) + 1 if layers else 0
    if declared != held and not (type(mtp) is int and mtp > 0 and held == declared + mtp):
        raise ConversionError(f"{path} says num_hidden_layers={declared} but the weights hold {held} layers: "
                              "fix config.json or use the weights it belongs to")


def validate_config(cfg: dict, path: Path) -> None:
    """Build transformers' config class for cfg['model_type'] from the dict (type checks included)."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    config_class = CONFIG_MAPPING[cfg["model_type"]]
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its warnings about token ids are not ours to show
    try:
        config_class.from_dict(cfg)
    except Exception as e:  # huggingface_hub's StrictDataclassError, ValueError, TypeError: all refusals
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ConversionError(f"{path} is refused by transformers' {config_class.__name__}: {detail}") from e
    finally:
        logging.set_verbosity(verbosity)


def checked_spec(cfg: dict, path: Path, tensor_names=None) -> tuple[Family, ModelSpec]:
    """Family and ModelSpec of a config.json, after the layer count (against `tensor_names`, when
    given) and the types (transformers) are checked."""
    family = family_for(cfg.get("model_type"))
    if tensor_names is not None:
        check_layer_count(cfg, tensor_names, path, family)
    try:
        found = spec_from_config(cfg)  # first, for its specific refusals (rope type, bias, activation)
    except (TypeError, ValueError) as e:  # a value of the wrong type: transformers names the field
        validate_config(cfg, path)
        raise ConversionError(f"{path}: a value has the wrong type ({e})") from e
    validate_config(cfg, path)
    return found
