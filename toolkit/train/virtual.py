"""Virtual pipeline stages (interleaved 1F1B, `parallel.vpp=V`): each pipeline rank holds V model
chunks, and megatron-core's interleaved schedule runs them.

With PP ranks and V chunks the model is cut into PP x V stages of layers/(PP x V) layers each;
chunk v of pipeline rank r is stage v x PP + r (megatron-core's `vp_stage`: its layer offset,
and whether it holds the embedding (stage 0) or the output layer (the last stage)). So every
chunk is exactly one stage of a plain pipeline of PP x V stages: it loads from and saves to that
layout's per-rank files (`toolkit.convert` reads and exports them unchanged), and `torch_dist`
is layout-independent anyway.

DeepSpeed sees one module, `VirtualStages` (a ModuleList of the chunks): one engine, one ZeRO
optimizer over every chunk's parameters, the mpu adapter unchanged. The schedule calls the
engine with `stage=v`, which forwards chunk v.

p2p: megatron-core's default `batch_p2p_comm=True` is silently wrong at PP = 2 in the
interleaved schedule (measured: the loss off by 1.1e-1 within 2 steps at PP 2 x VPP 2 with 8
micro-batches, tests/test_virtual_pipeline.py's guard, which prints it), so the toolkit sends and
receives one by one.
"""

from __future__ import annotations

import torch

from toolkit.dsconfig import rules
from toolkit.errors import ConfigError


def schedule_settings(pp: int, vpp: int) -> dict:
    """TransformerConfig fields of the interleaved schedule (none without virtual stages)."""
    if vpp == 1:
        return {}
    return dict(virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=False)


def check_virtual_layout(num_layers: int, pp: int, vpp: int, num_microbatches: int | None = None,
                         is_moe: bool = False) -> None:
    """megatron-core's rules for interleaving (toolkit.dsconfig.rules, which ds-config and plan
    apply too), one line each, before any model is built."""
    problem = rules.virtual_pipeline(pp, vpp, num_microbatches, num_layers)
    if problem:
        raise ConfigError(problem.replace(f"VPP {vpp}", f"parallel.vpp={vpp}", 1))  # in the recipe's terms
    if vpp > 1 and is_moe:  # a Mixture-of-Experts pipeline is not proven with virtual stages yet
        raise ConfigError(f"parallel.vpp={vpp} with a Mixture-of-Experts model is not supported yet; use parallel.vpp=1")


class VirtualStages(torch.nn.ModuleList):
    """This pipeline rank's chunks as one module for DeepSpeed; `forward(..., stage=v)` runs chunk v."""

    def forward(self, *args, stage: int, **kwargs):
        return self[stage](*args, **kwargs)

    @property
    def config(self):
        return self[0].config  # the chunks share one TransformerConfig

    def index(self, chunk) -> int:
        return next(v for v, c in enumerate(self) if c is chunk)

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        """Megatron-LM's nesting (model0, model1, ...); the sharded keys inside are global already."""
        return {f"model{v}": chunk.sharded_state_dict(*args, **kwargs) for v, chunk in enumerate(self)}


def chunks(module) -> list:
    """The model chunks of `module`: the chunks of VirtualStages, a vision-language model's language model
    (toolkit.vlm.model: its GPTModel), or the module itself."""
    if isinstance(module, VirtualStages):
        return list(module)
    return [getattr(module, "language_model", module)]


def stages(module) -> list[tuple[int, int, object]]:
    """[(stages of the plain pipeline, stage, chunk)] of this rank: its chunks as plain stages."""
    from toolkit.convert.load import pipeline_stage

    return [(*pipeline_stage(chunk), chunk) for chunk in chunks(module)]
