"""Per-GPU memory of a training layout: model states (ZeRO) and activations (1F1B or interleaved),
stage by stage.

    est = estimate(spec, setup, seq_len=4096, recompute="full")
    print("\\n".join(est.table()))

The DeepSpeed config the estimate assumes is the one `toolkit.dsconfig.build` writes for `setup`,
so bucket sizes and ZeRO-3 thresholds are the ones the job will run with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from toolkit.dsconfig import Setup, build
from toolkit.errors import ConfigError
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout
from toolkit.memory import activations as act
from toolkit.memory.activations import GPU, Kernels, Shape
from toolkit.memory.lora import LoraShape, activation_change, adapter_numels
from toolkit.memory.params import stage_buffer_bytes, stage_param_numels
from toolkit.memory.states import ModelStates, ZeroSettings, combined, frozen_states, fsdp_states, model_states
from toolkit.units import size

GIB = 1 << 30
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # fp8: bf16 weights (FP8 copies: fp8_extra_bytes)
# precision=fp8, as each spec keeps it. Transformer Engine (the GPU profile) keeps the inputs of its FP8
# linears for the weight-gradient GEMM in FP8, and caches each FP8 weight's quantized data across the
# micro-batches of a step in both layouts its GEMMs read, row-wise and column-wise (Float8Tensor /
# MXFP8Tensor usages; block scales, 1/32 or 1/128 of that, left out). The local spec (torchao,
# toolkit/fp8/local.py) keeps bf16 inputs and quantizes each weight at its GEMM, one at a time: bf16's figures.
FP8_BYTES = 1
FP8_WEIGHT_LAYOUTS = 2
# CUDA context, cuBLAS workspaces and NCCL communicator buffers on each GPU. An assumption for
# planning (typically 1-3 GiB on H100/A100 with NCCL), not measured here; 0 on CPU.
RUNTIME_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class StageMemory:
    stage: int
    states: ModelStates
    activations: int
    temporaries: int  # logits, attention buffer, recompute working set, the routers' expert-bias buffers
    reserve: int
    reference: int | None = None  # method=dpo: the frozen reference copy's weights (0 with LoRA); None: not DPO

    @property
    def buffers(self) -> int:
        return self.states.buffers + self.temporaries

    @property
    def gpu(self) -> int:
        return (self.states.params + self.states.grads + self.states.optimizer + self.activations + self.buffers
                + self.reserve + (self.reference or 0))

    def rows(self) -> list[tuple[str, int]]:
        rows = [("parameters", self.states.params), ("gradients", self.states.grads),
                ("optimizer states", self.states.optimizer), ("activations", self.activations),
                ("buffers and temporaries", self.buffers), ("runtime reserve (assumed)", self.reserve)]
        if self.reference is not None:
            rows.insert(1, ("DPO reference weights", self.reference))
        return rows


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    seq_len: int
    recompute: str
    kernels: Kernels
    stages: tuple[StageMemory, ...] = field(default_factory=tuple)
    lora: LoraShape | None = None
    ep: int = 1
    dp_engine: str = "deepspeed"
    cp: int = 1  # context parallelism (setup.dp is then DP x CP)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.gpu)

    @property
    def gpu_bytes(self) -> int:
        return self.peak.gpu

    @property
    def host_bytes_per_gpu(self) -> int:
        return max(s.states.host for s in self.stages)

    @property
    def nvme_bytes_per_gpu(self) -> int:
        return max(s.states.nvme for s in self.stages)

    def fits(self, gpu_memory: int) -> bool:
        return self.gpu_bytes <= gpu_memory

    def table(self, gpus_per_node: int = 8) -> list[str]:
        stages = self.stages
        header = f"{'per GPU':<28}" + "".join(f"{'stage ' + str(s.stage):>12}" for s in stages)
        lines = [header]
        for i, (label, _) in enumerate(stages[0].rows()):
            lines.append(f"{label:<28}" + "".join(f"{size(s.rows()[i][1]):>12}" for s in stages))
        lines.append(f"{'total':<28}" + "".join(f"{size(s.gpu):>12}" for s in stages))
        if self.host_bytes_per_gpu or self.nvme_bytes_per_gpu:
            host = self.host_bytes_per_gpu
            lines.append(f"offload: host memory {size(host)} per GPU, {size(host * gpus_per_node)} per "
                         f"{gpus_per_node}-GPU node; NVMe {size(self.nvme_bytes_per_gpu)} per GPU")
        return lines


def estimate(spec: ModelSpec, setup: Setup, seq_len: int, recompute: str = "none", kernels: Kernels = GPU,
             sequence_parallel: bool = False, reserve: int | None = None, lora: LoraShape | None = None,
             ep: int = 1, dp_engine: str = "deepspeed", cp: int = 1, dpo: bool = False) -> Estimate:
    """Memory per GPU for every pipeline stage of `setup` (the heaviest one is `.peak`); with
    `lora`, of a LoRA fine-tune: the base frozen, the adapter trained (toolkit.memory.lora); with
    `ep`, an MoE model's experts split over EP ranks carved out of DP (parallel.ep); with
    dp_engine="fsdp", PyTorch FSDP2 instead of DeepSpeed (setup.zero unused). With `cp`, context
    parallelism: `setup` is DeepSpeed's view of the run (toolkit.train.build.ds_setup), whose DP is
    DP x CP (ZeRO partitions over it) and whose global batch counts each CP rank's share of a
    sequence; the activations are per rank's seq_len / CP tokens (toolkit.memory.activations).
    With `dpo`, of method=dpo: setup.micro_batch counts pairs, so twice as many sequences per
    forward, and a full fine-tune holds a frozen copy of its stage's weights as the reference
    (LoRA: none, the adapter is disabled instead). The reference's forward-only pass keeps no
    activations."""
    if cp > 1 and (setup.dp % cp or seq_len % (2 * cp)):
        raise ConfigError(f"CP {cp} needs DP x CP ({setup.dp}) divisible by CP and a sequence length ({seq_len}) "
                          f"divisible by 2 x CP")
    check_ep(spec, setup, ep, lora)
    check_fsdp(spec, setup, dp_engine, lora, ep)
    check_fp8(setup, lora, dp_engine)
    if recompute not in act.RECOMPUTE:
        raise ValueError(f"recompute must be one of {act.RECOMPUTE}")
    if sequence_parallel and setup.tp == 1:
        raise ConfigError("sequence parallelism needs TP > 1: it splits the sequence over the TP ranks")
    if sequence_parallel and seq_len % setup.tp:
        raise ConfigError(f"sequence length {seq_len} is not divisible by TP {setup.tp}, which sequence parallelism splits it over")
    zero = ZeroSettings.from_config(build(setup, spec))
    reserve = (RUNTIME_RESERVE_BYTES if kernels is GPU else 0) if reserve is None else reserve
    kernels = act.local_kernels_for(spec, kernels)  # multi-latent attention: the local spec on a GPU too
    shape = Shape(seq_len, setup.micro_batch * (2 if dpo else 1), setup.tp, WEIGHT_BYTES[setup.precision], sequence_parallel,
                  cp, FP8_BYTES if te_fp8(setup, kernels) else None)
    stages = tuple(_stage(spec, setup, zero, shape, kernels, recompute, s, reserve, lora, ep, dp_engine)
                   for s in range(setup.pp))
    if dpo:
        stages = tuple(replace(s, reference=0 if lora is not None else
                               sum(stage_param_numels(spec, setup.tp, setup.pp, s.stage, ep)) * WEIGHT_BYTES[setup.precision])
                       for s in stages)
    return Estimate(setup, seq_len, recompute, kernels, stages, lora, ep, dp_engine, cp)


DP_ENGINES = ("deepspeed", "fsdp")


def check_fp8(setup: Setup, lora: LoraShape | None, dp_engine: str) -> None:
    """What the recipe refuses with precision=fp8 (toolkit.train.config._validate_fp8)."""
    if setup.precision == "fp8" and (lora is not None or dp_engine == "fsdp"):
        raise ConfigError(f"precision=fp8 with {'LoRA' if lora is not None else 'FSDP'} is not supported yet; use bf16")


def check_fsdp(spec: ModelSpec, setup: Setup, dp_engine: str, lora: LoraShape | None, ep: int) -> None:
    """The layouts the recipe trains with parallel.dp_engine=fsdp (toolkit.train.config, build)."""
    if dp_engine not in DP_ENGINES:
        raise ConfigError(f"dp_engine must be one of {', '.join(DP_ENGINES)}, got {dp_engine!r}")
    if dp_engine != "fsdp":
        return
    if setup.pp > 1:
        raise ConfigError(f"FSDP is offered at PP = 1 only, not PP {setup.pp}")
    if setup.precision == "fp16":
        raise ConfigError("FSDP with fp16 is not supported; use bf16")
    if lora is not None or ep > 1 or spec.is_moe:
        raise ConfigError("FSDP is offered for full fine-tuning of dense models only (no LoRA, no MoE)")


def fsdp_layer_numels(spec: ModelSpec, tp: int) -> tuple[int, int]:
    """(elements of one transformer layer, elements outside the layers) on one TP rank."""
    layers = spec.num_layers
    other = replace(spec, num_layers=layers + 1)
    one_layer = sum(stage_param_numels(other, tp, 1, 0)) - sum(stage_param_numels(spec, tp, 1, 0))
    return one_layer, sum(stage_param_numels(spec, tp, 1, 0)) - layers * one_layer


def check_ep(spec: ModelSpec, setup: Setup, ep: int, lora: LoraShape | None = None) -> None:
    """The layouts the recipe builds with parallel.ep (toolkit.train.build, init_parallel)."""
    if ep == 1:
        return
    if not spec.is_moe:
        raise ConfigError(f"EP {ep} needs a Mixture-of-Experts model; {spec.family} has no experts")
    if spec.num_experts % ep or setup.dp % ep:
        raise ConfigError(f"EP {ep} must divide the number of experts ({spec.num_experts}) and DP ({setup.dp})")
    if setup.zero == 3:
        raise ConfigError(f"EP {ep} with ZeRO-3: DeepSpeed's ZeRO-3 does not partition expert parameters over "
                          "the expert-data-parallel group; use ZeRO-1 or 2")
    if lora is not None:
        raise ConfigError(f"EP {ep} with LoRA is not estimated")


def backward_calls(setup: Setup) -> int:
    """Backward passes per optimizer step on one rank: one per micro-batch either way; DeepSpeed
    accumulates for gradient_accumulation_steps, megatron-core for the micro-batches."""
    return setup.micro_batches


def in_flight(setup: Setup, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B: the first stage
    runs pp warm-up forwards before its first backward; the last stage only one."""
    if setup.pp == 1:
        return 1
    return min(setup.pp - stage, setup.micro_batches)


def chunks_in_flight(setup: Setup, stage: int) -> list[list[int]]:
    """Interleaved 1F1B (VPP > 1): the micro-batches held per model chunk by pipeline rank `stage`
    after each of its forwards, in megatron-core's order (schedules.py get_pp_rank_microbatches and
    get_schedule_table, micro-batches in groups of PP): 2 (PP - stage - 1) + (VPP - 1) PP warm-up
    forwards, then one forward and one backward, the backwards taking the chunks in reverse."""
    pp, vpp, m = setup.pp, setup.vpp, setup.micro_batches
    total = m * vpp
    warmup = min(total, 2 * (pp - stage - 1) + (vpp - 1) * pp)
    held, history = [0] * vpp, []

    def forward(k):
        held[(k // pp) % vpp] += 1
        history.append(list(held))

    def backward(k):
        held[vpp - 1 - (k // pp) % vpp] -= 1

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    return history


def _stage_activations(setup: Setup, stage: int, layers: int, layer: int, first_bytes: int, final: int) -> int:
    """Peak activation bytes of pipeline rank `stage`: its in-flight micro-batches times what each
    keeps (a chunk's layers; the embedding's output on the first stage, the loss's on the last)."""
    first, last = stage == 0, stage == setup.pp - 1
    if setup.vpp == 1:
        return in_flight(setup, stage) * (layers * layer + first * first_bytes) + last * final
    per_chunk = [layers // setup.vpp * layer + (first and v == 0) * first_bytes + (last and v == setup.vpp - 1) * final
                 for v in range(setup.vpp)]
    return max(sum(n * b for n, b in zip(held, per_chunk)) for held in chunks_in_flight(setup, stage))


def _stage(spec, setup, zero, shape, kernels, recompute, stage, reserve, lora, ep, dp_engine) -> StageMemory:
    layers = spec.num_layers // setup.pp
    padded_vocab = Layout(setup.tp, setup.pp).padded_vocab(spec.vocab_size)
    last = stage == setup.pp - 1
    layer = act.stage_layer_bytes(spec, shape, kernels, recompute, Layout(setup.tp, setup.pp).stage_layers(spec, stage))
    working_set = act.recompute_working_set(spec, shape, kernels, recompute)
    final = act.last_stage_bytes(spec, shape, kernels, padded_vocab)
    if lora is not None:
        change = activation_change(spec, lora, shape.tokens, setup.tp, shape.act_bytes)
        layer += change if recompute != "full" else 0
        working_set += change if recompute == "full" else 0
        final -= shape.act_bytes * shape.hidden_tokens(spec)  # the frozen output layer keeps no input
    activations = _stage_activations(setup, stage, layers, layer, act.first_stage_bytes(shape), final)
    temporaries = (working_set + act.attention_buffer(spec, shape, kernels) + act.dispatcher_buffers(spec, shape)
                   + last * act.logits_temporary(shape, padded_vocab) + stage_buffer_bytes(spec, setup.pp, stage)
                   + fp8_weight_copies(spec, setup, kernels, stage, ep))
    if dp_engine == "fsdp":
        layer_numel, root_numel = fsdp_layer_numels(spec, setup.tp)
        states = fsdp_states(stage_param_numels(spec, setup.tp, 1, 0), (layer_numel,), root_numel,
                             WEIGHT_BYTES[setup.precision], setup.dp)
    else:
        states = _states(spec, setup, zero, stage, lora, ep)
    return StageMemory(stage, states, activations, temporaries, reserve)


def te_fp8(setup: Setup, kernels) -> bool:
    """precision=fp8 on Transformer Engine's kernels (the GPU profile); the local spec's FP8 is priced as bf16."""
    return setup.precision == "fp8" and kernels.flash_attention


def fp8_weight_copies(spec, setup: Setup, kernels, stage: int, ep: int) -> int:
    """Transformer Engine's FP8 copies of this rank's decoder linear weights (FP8_WEIGHT_LAYOUTS)."""
    if not te_fp8(setup, kernels):
        return 0
    return FP8_WEIGHT_LAYOUTS * FP8_BYTES * sum(stage_param_numels(spec, setup.tp, setup.pp, stage, ep, "fp8_linears"))


def _states(spec, setup, zero, stage, lora, ep: int = 1) -> ModelStates:
    weight_bytes = WEIGHT_BYTES[setup.precision]
    if lora is None and ep > 1:
        # The routed experts are partitioned over the expert-data-parallel group (DP / EP ranks
        # holding the same experts, toolkit.train.experts), everything else over all of DP.
        dense = model_states(stage_param_numels(spec, setup.tp, setup.pp, stage, ep, "dense"), weight_bytes,
                             setup.dp, zero, backward_calls(setup))
        experts = model_states(stage_param_numels(spec, setup.tp, setup.pp, stage, ep, "experts"), weight_bytes,
                               setup.dp // ep, zero, backward_calls(setup))
        return combined(dense, experts)
    numels = stage_param_numels(spec, setup.tp, setup.pp, stage, ep)
    if lora is None:
        return model_states(numels, weight_bytes, setup.dp, zero, backward_calls(setup))
    adapter = model_states(adapter_numels(spec, lora, setup.tp, setup.pp), weight_bytes, setup.dp, zero,
                           backward_calls(setup))
    return frozen_states(numels, weight_bytes, setup.dp, zero, adapter)


__all__ = ["Estimate", "StageMemory", "estimate", "GIB"]
