"""Tensors transformers keeps in float32 among weights of another dtype, and how the toolkit carries them.

A model class lists them in `_keep_in_fp32_modules_strict`: a model loaded in bf16 or fp16 keeps them in
float32 (modeling_utils.py `_get_dtype_plan`, each pattern searched in the tensor names through
core_model_loading.build_glob_alternation) and saves them so. GLM-4.5 and DeepSeek-V3 list the expert bias
(`e_score_correction_bias`) in transformers 5.23, the router weight (`gate.weight`) too from 5.24: a bf16
checkpoint saved by 5.23 stores the router in bf16, one saved by 5.24 in float32.

The family's rows flag them (Row.float32_buffer, Row.float32_parameter), and tests/test_float32_routers.py
checks the flags against the installed class. They are
  * converted as stored: the megatron checkpoint (torch or torch_dist) holds each in the HF file's dtype;
  * loaded into a megatron-core model as megatron-core keeps them: a parameter (the router weight) cast to
    the model's dtype, the expert-bias buffer in float32 (router.py _maintain_float32_expert_bias);
  * exported as stored from a converted checkpoint (a bit-exact round trip), and from a training run's fp32
    master weights (CheckpointMeta.master_weights) as the installed class keeps them: float32 where its
    `_keep_in_fp32_modules_strict` names them, the weights' dtype elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from toolkit.families.table import Family

if TYPE_CHECKING:  # the families are read without torch (the CLI's start-up)
    import torch

# The weights' dtypes transformers applies _keep_in_fp32_modules_strict to (modeling_utils.py _get_dtype_plan)
STRICT_DTYPES = ("float16", "bfloat16")


def installed_float32(family: Family) -> tuple[str, ...]:
    """The `_keep_in_fp32_modules_strict` of the installed transformers class of `family` (() where it lists none)."""
    import transformers

    cls = getattr(transformers, family.architecture, None)
    return tuple(sorted(getattr(cls, "_keep_in_fp32_modules_strict", None) or ()))


def kept_by_installed(family: Family, dtype: torch.dtype | None) -> Callable[[str], bool]:
    """Whether the installed class keeps the HF tensor of that name in float32 in a model of `dtype`."""
    patterns = installed_float32(family) if str(dtype).removeprefix("torch.") in STRICT_DTYPES else ()
    if not patterns:
        return lambda name: False
    from transformers.core_model_loading import build_glob_alternation

    regex = build_glob_alternation(list(patterns))[0]
    return lambda name: regex.search(name) is not None


def export_cast(family: Family, dtype: torch.dtype | None, as_stored: bool) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """(HF name, tensor) -> the tensor as the export writes it: in `dtype` (None: as read), but the tensors
    transformers keeps in float32 (Family.hf_float32) as stored where `as_stored` (a converted checkpoint
    holds them in the HF file's dtype), else in float32 where the installed class keeps them so."""
    kept, installed = family.hf_float32, kept_by_installed(family, dtype)

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if dtype is None or not tensor.is_floating_point():
            return tensor
        if name.endswith(kept):
            if as_stored:
                return tensor
            if installed(name):
                return tensor.float()
        return tensor.to(dtype)

    return cast
