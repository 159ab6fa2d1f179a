"""The HF PEFT adapter directory, as `PeftModel.save_pretrained` writes and `from_pretrained` reads it:

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path, ...
    adapter_model.safetensors    base_model.model.<HF module>.lora_A.weight / .lora_B.weight
                                 (and the fused experts' target_parameters: toolkit.lora.experts;
                                 linears PEFT would rewrite as `<name>.weight` ones: toolkit.lora.peft_rewrites)
    toolkit_base.json            ours: the megatron base checkpoint the adapter was trained on, and its checksum
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import AdapterError
from toolkit.lora import peft_rewrites

CONFIG, WEIGHTS, BASE = "adapter_config.json", "adapter_model.safetensors", "toolkit_base.json"


def peft_key(hf_module: str, which: str) -> str:
    """PEFT's saved name of a LoRA weight (the adapter name is dropped on save)."""
    return f"base_model.model.{hf_module}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    # PEFT's target_parameters: the fused expert weights adapted (toolkit.lora.experts)
    target_parameters: tuple[str, ...] = ()
    # target modules written as `<name>.weight` target parameters, which PEFT does not rewrite
    # onto the experts (toolkit.lora.peft_rewrites)
    as_parameters: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)."""
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)


def base_reference(checkpoint: Path) -> dict:
    """The base checkpoint an adapter belongs to: its path and one checksum over its files'
    sha256 (recorded at conversion), or over the files themselves when it records none."""
    from toolkit.convert.metadata import CheckpointMeta, checksum_tree

    checkpoint = Path(checkpoint).resolve()
    sums = CheckpointMeta.read(checkpoint).checksums or checksum_tree(checkpoint)
    digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
    return {"checkpoint": str(checkpoint), "sha256": digest}


def check_base(adapter_dir: Path, checkpoint: Path) -> None:
    """Refuse an adapter recorded for another base checkpoint (PEFT's own adapters record none)."""
    path = Path(adapter_dir) / BASE
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    actual = base_reference(checkpoint)
    if recorded.get("sha256") != actual["sha256"]:
        raise AdapterError(f"adapter {adapter_dir} was trained on {recorded.get('checkpoint')} (checksum "
                           f"{str(recorded.get('sha256'))[:12]}), not on {checkpoint} (checksum {actual['sha256'][:12]})")


def read_settings(adapter_dir: Path) -> LoraSettings:
    path = Path(adapter_dir) / CONFIG
    if not path.is_file() or not (Path(adapter_dir) / WEIGHTS).is_file():
        raise AdapterError(f"{adapter_dir} is not a PEFT adapter directory (needs {CONFIG} and {WEIGHTS})")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    modules = cfg.get("target_modules")
    modules = [modules] if isinstance(modules, str) else list(modules or [])
    # PEFT's all-linear saves full module paths (model.layers.0.mlp.down_proj); PEFT matches a name
    # by its last components, so the module name is what counts. An adapter of only some layers
    # is then refused when its tensors are checked against every layer's.
    linears, parameters = peft_rewrites.split(cfg.get("target_parameters") or ())
    modules = sorted({m.rsplit(".", 1)[-1] for m in modules} | set(linears))
    return LoraSettings(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)), tuple(modules),
                        bool(cfg.get("use_rslora", False)), parameters, tuple(sorted(set(linears))))


def read_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / WEIGHTS))


def write(out: Path, tensors: dict[str, torch.Tensor], settings: LoraSettings, base: dict, base_name: str | None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name or base["checkpoint"],
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(set(settings.target_modules) - set(settings.as_parameters)),
        "use_rslora": settings.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    parameters = [*settings.target_parameters, *peft_rewrites.as_parameters(settings.as_parameters)]
    if parameters:
        config["target_parameters"] = parameters
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out / BASE).write_text(json.dumps(base, indent=2) + "\n")
