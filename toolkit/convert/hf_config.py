"""config.json checked with transformers' own rules before we trust a number in it, and read
through transformers' config class (toolkit/families/hf_values.py).

transformers 5 config classes are strict dataclasses: `num_hidden_layers: "4"` or
`tie_word_embeddings: "no"` is refused there, so it is refused here with the same words. The
layer count is first compared with the weights, because some config classes build per-layer
lists (Qwen2's layer_types) and a huge `num_hidden_layers` would take minutes there.
"""

from __future__ import annotations

import re
from pathlib import Path

from toolkit.errors import ConversionError
from toolkit.families import ConfigReading, Family, ModelSpec, family_for, read_config

# model.layers.N. in most files; backbone.layers.N. in Nemotron-H's (toolkit/families/nemotron_h.py)
_HF_LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.")


def check_layer_count(cfg: dict, tensor_names, path: Path) -> None:
    """Refuse a num_hidden_layers that contradicts the layers present in the weights (`tensor_names`: those
    of an opened checkpoint, without the multi-token-prediction layers HF ignores, toolkit/convert/ignored.py)."""
    declared = cfg.get("num_hidden_layers")
    if type(declared) is not int:
        return  # a wrong type: transformers' config class reports it
    layers = {int(m.group(1)) for name in tensor_names if (m := _HF_LAYER.match(name))}
    held = max(layers) + 1 if layers else 0
    if declared != held:
        raise ConversionError(f"{path} says num_hidden_layers={declared} but the weights hold {held} layers: "
                              "fix config.json or use the weights it belongs to")


def checked_family(cfg: dict, path: Path, tensor_names=None) -> Family:
    """config.json's family, its layer count checked against `tensor_names` (when given): what is
    checked before transformers' config class reads the file."""
    family = family_for(cfg.get("model_type"))
    if tensor_names is not None:
        check_layer_count(cfg, tensor_names, path)
    return family


def checked_spec(cfg: dict, path: Path, tensor_names=None) -> tuple[Family, ModelSpec]:
    """Family and ModelSpec of a config.json, after the layer count (against `tensor_names`, when
    given) and the types (transformers' config class) are checked."""
    family, spec, _ = checked_reading(cfg, path, tensor_names)
    return family, spec


def checked_reading(cfg: dict, path: Path, tensor_names=None) -> tuple[Family, ModelSpec, ConfigReading]:
    """checked_spec, with which keys were read from the file and which transformers defaulted."""
    checked_family(cfg, path, tensor_names)
    try:
        return read_config(cfg, str(path))
    except (TypeError, ValueError) as e:  # a value transformers let through that is no number
        raise ConversionError(f"{path}: a value has the wrong type ({e})") from e


def config_reading(hf_dir: str | Path) -> ConfigReading:
    """Which keys of an HF model directory's config.json a conversion reads, and the values
    transformers' config class gives the ones it leaves out (`convert hf-to-megatron --verbose`)."""
    from toolkit.convert.hf_source import read_config

    path = Path(hf_dir) / "config.json"
    return checked_reading(read_config(Path(hf_dir)), path)[2]
