"""Which FP8 recipe runs where, the refusals, and the TransformerConfig fields of the TE spec.

The recipe names are megatron-core's `fp8_recipe` (tensorwise, delayed, blockwise, mxfp8), plus
torchao's rowwise on the local spec. Where each runs:

| recipe     | Transformer Engine spec (GPUs)                   | local spec (CPU, GPUs without TE) |
|------------|--------------------------------------------------|-----------------------------------|
| tensorwise | TE Float8CurrentScaling, compute capability 8.9+ | torchao tensorwise                |
| delayed    | TE DelayedScaling, 8.9+                          | refused (needs TE)                |
| blockwise  | TE Float8BlockScaling, Hopper (9.0) and later    | refused (needs TE)                |
| mxfp8      | TE MXFP8BlockScaling, Blackwell (10.0) and later | refused (needs TE)                |
| rowwise    | refused (no TE recipe)                           | torchao rowwise                   |
"""

from __future__ import annotations

from dataclasses import dataclass

TE_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
LOCAL_RECIPES = ("tensorwise", "rowwise")
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) have them; TE's block scaling needs Hopper, MXFP8 Blackwell
# (transformer_engine/pytorch/fp8.py check_*_support).
FP8_CAPABILITY = (8, 9)
RECIPE_CAPABILITY = {"blockwise": ((9, 0), "Hopper"), "mxfp8": ((10, 0), "Blackwell")}
# TE's fp8 format per recipe, as Megatron-Bridge's recipes set it: HYBRID (e4m3 forward, e5m2
# gradients) for per-tensor scaling, E4M3 throughout for the block-scaled ones.
TE_FORMAT = {"tensorwise": "hybrid", "delayed": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}


@dataclass(frozen=True)
class Device:
    """What the FP8 decision reads from the machine: CUDA or not, the GPU and its capability, the
    layer spec chosen and why (toolkit.model.layer_spec_choice), TE's version line where one is installed."""

    cuda: bool
    name: str = ""
    capability: tuple[int, int] = (0, 0)
    layer_spec: str = "local"
    why: str = ""
    te_installed: bool = False
    te_supported: bool = True
    te_line: str = ""


def this_device(layer_spec: str, why: str) -> Device:
    import torch

    from toolkit.runtime import megatron_versions

    version = megatron_versions.te_version()
    supported, line = megatron_versions.te_supported(version) if version is not None else (True, "")
    if not torch.cuda.is_available():
        return Device(False, layer_spec=layer_spec, why=why, te_installed=version is not None, te_supported=supported,
                      te_line=line)
    return Device(True, torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()), layer_spec, why,
                  version is not None, supported, line)


def refusal(fp8, device: Device) -> str | None:
    """The one line that refuses `fp8` (a TrainConfig's Fp8Config) on `device`, or None."""
    recipe = fp8.recipe
    if device.cuda and device.capability < FP8_CAPABILITY:
        return (f"precision=fp8 needs FP8 tensor cores, compute capability {'.'.join(map(str, FP8_CAPABILITY))} or later "
                f"(Ada, Hopper, Blackwell): {device.name} is {'.'.join(map(str, device.capability))}; use precision=bf16")
    if device.cuda and device.te_installed and not device.te_supported:
        return f"precision=fp8 with {device.te_line}: FP8 would run that TE's kernels; install a TE in that range"
    if device.layer_spec == "te":
        if recipe not in TE_RECIPES:
            return (f"fp8.recipe={recipe} is torchao's, for the local spec; Transformer Engine's recipes are "
                    f"{', '.join(TE_RECIPES)}")
        needed = RECIPE_CAPABILITY.get(recipe)
        if needed and device.capability < needed[0]:
            runs = [r for r in TE_RECIPES if RECIPE_CAPABILITY.get(r, (FP8_CAPABILITY, ""))[0] <= device.capability]
            return (f"fp8.recipe={recipe} needs a {needed[1]} GPU (compute capability {'.'.join(map(str, needed[0]))} "
                    f"or later): {device.name} ({'.'.join(map(str, device.capability))}) runs {', '.join(runs)}")
        return None
    if recipe not in LOCAL_RECIPES:
        where = f"Transformer Engine, which is not usable here ({device.why})" if device.cuda else \
            "Transformer Engine, which runs on GPUs only"
        return (f"fp8.recipe={recipe} needs {where}; the local spec runs fp8.recipe=tensorwise or rowwise "
                "through torchao")
    return None


def te_fields(fp8) -> dict:
    """megatron-core's TransformerConfig fields for `fp8` on the Transformer Engine spec (get_fp8_recipe
    in fp8_utils.py maps fp8_recipe to TE's recipe object; TE's autocast wraps each layer)."""
    fields = dict(fp8=TE_FORMAT[fp8.recipe], fp8_recipe=fp8.recipe, fp8_param=fp8.param_gather,
                  first_last_layers_bf16=fp8.first_last_bf16)
    if fp8.first_last_bf16:
        fields.update(num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    if fp8.recipe == "delayed":
        fields.update(fp8_amax_history_len=fp8.amax_history_len, fp8_amax_compute_algo=fp8.amax_compute_algo,
                      fp8_margin=fp8.margin)
    return fields
