"""Target module names PEFT rewrites onto the fused experts, and how an adapter keeps them anyway.

PEFT (0.21, with transformers 5) converts the LoraConfig of a Mixture-of-Experts model whose
experts transformers 5 fused, on get_peft_model and on PeftModel.from_pretrained alike
(peft/utils/transformers_weight_conversion.py _convert_peft_config_moe): for the model types mapped
to the `qwen2_moe` pattern (GLM-4.5, DeepSeek-V3, Qwen3-MoE, OLMoE...) the target_modules
`gate_proj`, `up_proj`, `down_proj` become the routed experts' target_parameters (gate_up_proj with
r and alpha doubled) and leave target_modules. A shared expert or dense MLP adapted under those names
would then load as no LoRA at all, and the routed experts would be expected at another rank.

PEFT's ParamWrapper on the 2-D weight of such a linear (`target_parameters: gate_proj.weight`) is the
same LoRA (lora_A [r, in], lora_B [out, r], the delta B A * scaling on W), saved under the same keys
(`...shared_experts.gate_proj.lora_A.weight`), and is not rewritten. So for those families the
adapter_config.json lists these names as `<name>.weight` target parameters, and reading one back
turns them into target modules again. ParamWrapper takes no dropout: neither do these targets.
"""

from __future__ import annotations

WEIGHT = ".weight"  # a target parameter ending so is a linear's weight; the experts' fused ones do not


def rewritten(model_types) -> frozenset[str]:
    """The target module names PEFT rewrites for any of these model types (read from the installed
    PEFT's own tables, which decide what PeftModel.from_pretrained does)."""
    from peft.utils import transformers_weight_conversion as conversion

    names: set[str] = set()
    for model_type in model_types:
        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        if pattern and conversion.get_checkpoint_conversion_mapping(model_type) is not None:
            names |= set(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {}))
    return frozenset(names)


def split(target_parameters) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """adapter_config.json's target_parameters as (linear target modules, fused expert parameters)."""
    modules = tuple(p.removesuffix(WEIGHT).rsplit(".", 1)[-1] for p in target_parameters if p.endswith(WEIGHT))
    return modules, tuple(p for p in target_parameters if not p.endswith(WEIGHT))


def as_parameters(names) -> list[str]:
    return [name + WEIGHT for name in names]
