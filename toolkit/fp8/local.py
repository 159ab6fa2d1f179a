"""FP8 on the local spec: torchao's float8 training math inside megatron-core's column- and
row-parallel linears (CPU, and GPUs without Transformer Engine).

Each decoder-layer linear keeps its module, parameters and sharding; only its GEMM changes.
megatron-core calls `linear._forward_impl(input, weight, bias, ..., allreduce_dgrad,
sequence_parallel, tp_group)` from ColumnParallelLinear.forward and RowParallelLinear.forward
(tensor_parallel/layers.py, 0.16.1 to 0.19); `Fp8Forward` takes that call and does what
megatron-core's LinearWithGradAccumulationAndAsyncCommunication does around the GEMM, with the GEMM
in FP8 through torchao's `matmul_with_hp_or_float8_args`:

- sequence parallelism: the input all-gathered over TP before the GEMM and the input gradient
  reduce-scattered after it (megatron-core's gather_from_sequence_parallel_region); without it, a
  column-parallel input gradient all-reduced over TP (copy_to_tensor_model_parallel_region). The
  row-parallel output's reduction stays megatron-core's, in bf16, after the GEMM, as TE's does.
- scales per rank, as Transformer Engine computes them per rank: each rank quantizes its own
  weight shard and its own output gradient; the input is quantized after the sequence-parallel
  gather, so every TP rank computes the same scale from the whole input (TE reduces the amax over
  the TP group for the same result before its FP8 all-gather).
- what the recipe quantizes: tensorwise, one scale per tensor (e4m3 input and weight, e5m2
  output gradient: TE's Float8CurrentScaling, HYBRID format); rowwise, one scale per row of each
  GEMM operand, all e4m3, scales rounded to powers of two (torchao's "rowwise" recipe). Both
  quantize the three GEMMs of a linear: output, input gradient and weight gradient.

What stays in bf16, and why (the same linears megatron-core's TE path keeps out of FP8): the
embedding (a lookup, no GEMM); the output layer (megatron-core builds it as a plain
ColumnParallelLinear outside the transformer layers; FP8 logits would cost the loss its
precision); the MoE router (its top-k choice must not move with quantization; megatron-core runs
it in fp32 or the model's dtype); the MoE experts on the local spec (an expert can get no tokens
in a micro-batch, and an empty tensor has no amax: TE pads the token groups for FP8, megatron-core's
SequentialMLP does not); with fp8.first_last_bf16, the first and last decoder layers.
"""

from __future__ import annotations

import dataclasses
import functools

from toolkit.errors import ConfigError
from toolkit.runtime import megatron_versions

# fp8.recipe -> torchao's Float8LinearRecipeName (torchao/float8/config.py)
TORCHAO_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise"}


@functools.cache
def _torchao():
    """torchao's float8 training pieces, imported once (its import logs a torch deprecation notice
    about an Enum it registers, on every rank)."""
    import logging

    logging.getLogger("torch.utils._pytree").addFilter(lambda record: "register_constant" not in record.getMessage())
    try:
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise ConfigError(f"precision=fp8 on the local spec needs torchao's float8 training (pip install "
                          f"'torchao>=0.18,<0.19'): {e}") from None
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


def torchao_config(recipe: str, on_cuda: bool):
    """torchao's Float8LinearConfig of `recipe`, for the device the GEMMs run on. On CUDA: torch's
    `_scaled_mm` kernel, GEMM dimensions padded to multiples of 16 (which it requires). On CPU:
    torchao's emulated GEMM (`emulate`: the FP8 operands dequantized, one fp32 matmul), the same
    quantization with only the accumulation order changed: torch 2.14's CPU `_scaled_mm` is a
    reference loop on CPUs without native FP8 (1.0 s for a 512 x 256 by 256 x 256 GEMM on this
    project's 2-core Xeon, against 17 ms in bf16), which made a 4-step CPU fine-tune take minutes."""
    Float8LinearConfig = _torchao()[0]
    config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    return dataclasses.replace(config, pad_inner_dim=on_cuda, emulate=not on_cuda)


def device_config(recipe: str):
    """torchao_config for this process's device."""
    import torch

    return torchao_config(recipe, on_cuda=torch.cuda.is_available())


def mm_config(config):
    """torchao's per-GEMM settings (output, grad_input, grad_weight) from a Float8LinearConfig, as
    its Float8Linear builds them."""
    _, _, LinearMMConfig, ScaledMMConfig = _torchao()

    def gemm(settings):
        return ScaledMMConfig(config.emulate, settings.use_fast_accum, False, config.pad_inner_dim)

    return LinearMMConfig(gemm(config.gemm_config_output), gemm(config.gemm_config_grad_input),
                          gemm(config.gemm_config_grad_weight))


class Fp8Forward:
    """A ColumnParallelLinear's or RowParallelLinear's `_forward_impl` with the GEMM in FP8."""

    def __init__(self, linear, config):
        self.tp_group = getattr(linear, "tp_group", None)
        self.config = config
        self.mm = mm_config(config)

    def __call__(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                 sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **later):
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        megatron_versions.check_linear_forward_arguments(later)
        if gradient_accumulation_fusion or grad_output_buffer is not None:  # off in toolkit.model, refused if not
            raise ConfigError("precision=fp8 on the local spec takes no gradient_accumulation_fusion or deferred "
                              "weight-gradient buffers (the weight gradient is computed by the FP8 GEMM)")
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        output = _torchao()[1].apply(input, weight.t(), self.mm, self.config)
        return output + bias if bias is not None else output


def fp8_linears(chunks, first_last_bf16: bool, num_layers: int) -> dict:
    """{name: linear} of the decoder layers' column- and row-parallel linears that run in FP8 on
    this rank (`chunks`: its model chunks): every one but the experts' and the router's, and with
    `first_last_bf16` none of layers 1 and `num_layers` (megatron-core's global layer numbers)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    chosen = {}
    for c, chunk in enumerate(chunks):
        for layer in chunk.decoder.layers:
            if first_last_bf16 and layer.layer_number in (1, num_layers):
                continue
            for name, module in layer.named_modules():
                if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    continue
                if ".experts." in f".{name}." or "router" in name:
                    continue
                chosen[f"chunk{c}.layer{layer.layer_number}.{name}"] = module
    return chosen


def apply_fp8(chunks, recipe: str, first_last_bf16: bool, num_layers: int) -> list[str]:
    """Switch this rank's decoder linears to FP8 GEMMs of `recipe` (on CUDA, or emulated on CPU);
    returns their names."""
    config = device_config(recipe)
    chosen = fp8_linears(chunks, first_last_bf16, num_layers)
    for linear in chosen.values():
        linear._forward_impl = Fp8Forward(linear, config)  # shadows the class's method, per instance
    return sorted(chosen)
