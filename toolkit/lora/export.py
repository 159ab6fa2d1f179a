"""`toolkit convert megatron-to-hf --adapter [--merge]`: a LoRA training checkpoint to HF.

    export_adapter(step_dir, out)               the HF PEFT directory (PeftModel.from_pretrained loads it)
    export_adapter(step_dir, out, merge=True)   the whole HF model with W + s B A merged in fp32, then
                                                cast to the base checkpoint's dtype (as PEFT's merge_and_unload)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from toolkit.atomic import atomic_directory, refuse_output_overlapping_inputs
from toolkit.errors import AdapterError
from toolkit.lora import experts, peft_dir

ADAPTER_SUBDIR = "adapter"  # where a LoRA run's checkpoint keeps it (toolkit.train.checkpoint)


def adapter_in(step_dir: Path) -> Path:
    adapter_dir = Path(step_dir) / ADAPTER_SUBDIR
    if not (adapter_dir / peft_dir.CONFIG).is_file():
        raise AdapterError(f"{step_dir} holds no LoRA adapter ({ADAPTER_SUBDIR}/{peft_dir.CONFIG}): it is not a "
                           f"checkpoint of a run with peft.enabled=true; export a full fine-tune's {step_dir}/model "
                           "without --adapter")
    return adapter_dir


def merger(adapter_dir: Path, base: Path):
    """transform(hf_name, tensor) for megatron_to_hf: W + scaling * B @ A in fp32 on adapted weights;
    on a routed expert's weight its expert's rows of the fused delta (toolkit.lora.experts)."""
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.families import family_named

    settings = peft_dir.read_settings(adapter_dir)
    tensors = peft_dir.read_tensors(adapter_dir)
    spec = CheckpointMeta.read(base).model_spec
    family = family_named(spec.family)
    expert_slices = experts.merge_slices(family, spec, experts.resolve(family, spec, settings.target_parameters,
                                                                       settings.dropout))

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in expert_slices:
            target, layer, expert, rows = expert_slices[name]
            delta = experts.merge_delta(target, tensors[target.key(layer, "A")], tensors[target.key(layer, "B")],
                                        expert, spec.num_experts, settings.r, settings.scaling)
            return tensor.float() + delta[rows]
        module = name.removesuffix(".weight")
        a = tensors.get(peft_dir.peft_key(module, "A"))
        if a is None or not name.endswith(".weight"):
            return tensor
        b = tensors[peft_dir.peft_key(module, "B")]
        return tensor.float() + settings.scaling * (b.float() @ a.float())

    return transform


def export_adapter(step_dir: str | os.PathLike, out_dir: str | os.PathLike, *, merge: bool = False,
                   overwrite: bool = False, progress: bool | None = None) -> Path:
    adapter_dir = adapter_in(Path(step_dir))
    refuse_output_overlapping_inputs(out_dir, step_dir)
    if not merge:
        with atomic_directory(out_dir, overwrite) as tmp:
            for name in (peft_dir.CONFIG, peft_dir.WEIGHTS, peft_dir.BASE):
                shutil.copyfile(adapter_dir / name, tmp / name)
        return Path(out_dir)
    from toolkit.convert import megatron_to_hf

    base = Path(json.loads((adapter_dir / peft_dir.BASE).read_text())["checkpoint"])
    peft_dir.check_base(adapter_dir, base)
    return megatron_to_hf(base, out_dir, overwrite=overwrite, progress=progress, transform=merger(adapter_dir, base))
