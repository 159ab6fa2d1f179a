"""A shrunk copy of an HF model, for `toolkit parity --shrink-layers N` when the model does not fit
one process: its first N decoder layers, and everything else (the rest of config.json, embeddings,
final norm, output layer, tokenizer) as it is. The copy is converted again by this toolkit, so it
checks the conversion of this config and the training setup, not the files of the user's checkpoint."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from toolkit.errors import ParityError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SKIPPED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # model.layers.7.mlp.up_proj.weight -> 7


def shrunk_spec(spec, layers: int):
    """The model spec of the first `layers` layers (per-layer strings cut to them)."""
    return dataclasses.replace(spec, num_layers=layers,
                               window_layers=spec.window_layers[:layers] if spec.window_layers else None)


def check_layers(spec, layers: int, pp: int, vpp: int) -> None:
    if not 1 <= layers < spec.num_layers:
        raise ParityError(f"--shrink-layers {layers}: give a number of layers from 1 to {spec.num_layers - 1} "
                          f"(the model has {spec.num_layers})")
    if layers % (pp * vpp):
        raise ParityError(f"--shrink-layers {layers} is not divisible by the recipe's PP {pp} x VPP {vpp}, which "
                          "splits the layers: give a multiple of it")


def layers_that_fit(spec, fits, pp: int, vpp: int) -> int | None:
    """The most layers, a multiple of PP x VPP and fewer than the model's, whose shrunk spec `fits`."""
    step = pp * vpp
    for layers in range((spec.num_layers - 1) // step * step, 0, -step):
        if fits(shrunk_spec(spec, layers)):
            return layers
    return None


def shrink_hf(hf_dir: Path, out: Path, layers: int) -> Path:
    """OUT: hf_dir's first `layers` layers as an HF model directory (one model.safetensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((hf_dir / "config.json").read_text())
    if "text_config" in config:
        raise ParityError(f"{hf_dir} is a multimodal model: --shrink-layers shrinks text-only models")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ParityError(f"{hf_dir} has no .safetensors weights, which --shrink-layers reads")
    total = config["num_hidden_layers"]
    for key, value in list(config.items()):  # per-layer lists (layer_types, ...) cut to the layers kept
        if isinstance(value, list) and len(value) == total:
            config[key] = value[:layers]
    config["num_hidden_layers"] = layers
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                index = LAYER_KEY.search(name)
                if index is None or int(index.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in hf_dir.iterdir():  # tokenizer, generation config, chat template...
        if extra.is_file() and extra.suffix not in WEIGHT_SUFFIXES and extra.name not in SKIPPED:
            shutil.copy2(extra, out / extra.name)
    return out
