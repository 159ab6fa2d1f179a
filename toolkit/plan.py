"""`plan`: every valid (TP, PP, DP, EP, ZeRO, offload, micro-batch, recompute) layout for a model on a
GPU budget, the ones that fit in memory, ranked by a simple throughput model.

A layout is valid when `toolkit.dsconfig.build` accepts it (so `plan` can never propose a config
the builder would refuse); it fits when `toolkit.memory.estimate` stays within the GPU memory
(and the host memory, if given). TP stays inside a node. For an MoE model every EP that divides
DP and the number of experts is tried (the throughput model does not price EP's all-to-all yet,
so equal-speed layouts keep the smaller EP first). At sequences of CP_MIN_SEQ tokens or more, every
context-parallel size (parallel.cp: powers of two dividing DP x CP and the sequence's 2·CP chunks)
is tried too: each rank then holds seq / CP tokens of activations. When nothing fits, the result
says so and says what would: offload, more GPUs, recompute, or context parallelism. The search can be
narrowed to the recompute modes a user accepts (`recompute`) and CP sizes up to `max_cp`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from toolkit.dsconfig import OptimizerSettings, Setup, build
from toolkit.errors import ConfigError
from toolkit.families.spec import ModelSpec
from toolkit.memory import GIB, GPU, Estimate, estimate
from toolkit.memory.estimate import check_fp8, check_fsdp
from toolkit.memory.lora import LoraShape
from toolkit.throughput import Hardware, StepTime, step_time

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
# (optimizer, parameter) offload options, least traffic first
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
MAX_PP = 16
# How far `plan` looks for "more GPUs would fit": node counts up to this multiple.
MAX_GPU_MULTIPLE = 64
# Context parallelism is enumerated from this sequence length on (shorter ones fit without it).
CP_MIN_SEQ = 8192
MAX_CP = 16


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory: int  # bytes
    gpus_per_node: int = 8
    host_memory_per_node: int | None = None  # bytes; None = don't limit offload
    hardware: Hardware = field(default_factory=Hardware)


@dataclass(frozen=True)
class Candidate:
    setup: Setup
    recompute: str
    memory: Estimate
    time: StepTime

    @property
    def offloaded(self) -> bool:
        return self.setup.offload_optimizer != "none" or self.setup.offload_param != "none"

    def explain(self, cluster: Cluster) -> str:
        s, t = self.setup, self.time
        parts = [
            f"TP{s.tp} {'in-node' if s.tp <= cluster.gpus_per_node else 'ACROSS nodes'}",
            f"PP{s.pp}{f' x VPP{s.vpp}' if s.vpp > 1 else ''} bubble {t.bubble:.0%} (m={s.micro_batches})"
            if s.pp > 1 else "no PP",
            f"DP{s.dp} {'FSDP' if self.memory.dp_engine == 'fsdp' else f'ZeRO-{s.zero}'}"
            + (f" grads {t.dp_comm:.2f}s" if s.dp > 1 else ""),
            *([f"EP{self.memory.ep}"] if self.memory.ep > 1 else []),
            *([f"CP{self.memory.cp} (DP{s.dp // self.memory.cp} x CP{self.memory.cp})"] if self.memory.cp > 1 else []),
            f"mb {s.micro_batch}, recompute {self.recompute}",
        ]
        if self.offloaded:
            parts.append(f"offload {s.offload_optimizer}/{s.offload_param} {t.offload:.2f}s, "
                         f"host {self.memory.host_bytes_per_gpu * cluster.gpus_per_node / GIB:.0f} GiB/node")
        parts.append(f"{self.memory.gpu_bytes / GIB:.1f}/{cluster.gpu_memory / GIB:.0f} GiB")
        return "; ".join(parts) + f" -> ~{t.tokens_per_gpu_s:,.0f} tok/s/GPU"


@dataclass
class Plan:
    cluster: Cluster
    ranked: list[Candidate]  # fitting layouts, best first
    smallest: Candidate | None  # the least memory of all, when nothing fits
    advice: list[str]

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def fits_without_offload(self) -> bool:
        return any(not c.offloaded for c in self.ranked)


def plan(spec: ModelSpec, cluster: Cluster, seq_len: int = 4096, global_batch: int | None = None,
         precision: str = "bf16", schedule: str = "megatron", allow_offload: bool = True,
         lora: LoraShape | None = None, vpp: int = 1, dp_engine: str = "deepspeed", dpo: bool = False,
         recompute: tuple[str, ...] = RECOMPUTE, max_cp: int = MAX_CP) -> Plan:
    """With `lora`, the layouts of a LoRA fine-tune (toolkit.memory.lora), and advice that says
    whether full fine-tuning would fit too. `vpp`: virtual stages per pipeline rank of every layout
    with PP > 1 (interleaved 1F1B); layouts that break its rules are left out. dp_engine="fsdp":
    PyTorch FSDP2 layouts (the recipe's parallel.dp_engine=fsdp: PP = 1, no offload; its step time
    taken as ZeRO-3's). `dpo`: method=dpo's memory (toolkit.memory.estimate: pairs per micro-batch, the
    reference copy of a full fine-tune); the step time is not yet priced for its reference pass.
    `recompute`: the recompute modes tried (full recompute costs a second forward pass); `max_cp`: the
    largest context-parallel size tried (1: none). When they rule out every layout, the advice says
    what the full search finds."""
    if not recompute or set(recompute) - set(RECOMPUTE):
        raise ConfigError(f"recompute modes must be among {', '.join(RECOMPUTE)}, got {', '.join(recompute) or 'none'}")
    if max_cp < 1:
        raise ConfigError(f"the largest context-parallel size must be 1 or more, got {max_cp}")
    recompute = tuple(mode for mode in RECOMPUTE if mode in recompute)  # least recompute first
    global_batch = global_batch or default_global_batch(cluster.gpus)
    if dp_engine == "fsdp":
        check_fsdp(spec, Setup(gpus=cluster.gpus, precision=precision), dp_engine, lora, 1)
    check_fp8(Setup(gpus=cluster.gpus, precision=precision), lora, dp_engine)

    def search(offload: bool, modes: tuple[str, ...], cp: int) -> list[Candidate]:
        return list(_candidates(spec, cluster, seq_len, global_batch, precision, schedule, offload, lora, vpp,
                                dp_engine, dpo=dpo, recompute=modes, max_cp=cp))

    candidates = search(allow_offload, recompute, max_cp)
    fitting = _ranked(candidates, cluster)
    smallest = min(candidates, key=lambda c: c.memory.gpu_bytes, default=None)
    result = Plan(cluster, fitting, None if fitting else smallest, [])
    result.advice = _advice(spec, cluster, seq_len, global_batch, precision, schedule, result, lora, vpp, dpo=dpo,
                            recompute=recompute, max_cp=max_cp)
    limits = ([f"recompute {'/'.join(recompute)}"] if recompute != RECOMPUTE else []) + \
             ([f"CP <= {max_cp}"] if max_cp < MAX_CP else [])
    if limits and not result.fits_without_offload:  # what the limits left out: the search without them
        wider = _ranked(search(False, RECOMPUTE, MAX_CP), cluster)
        result.advice.append(_what_the_full_search_finds(wider, cluster, limits))
    if lora is not None:
        full = plan(spec, cluster, seq_len, global_batch, precision, schedule, allow_offload, vpp=vpp, dpo=dpo,
                    recompute=recompute, max_cp=max_cp)
        result.advice.append(_lora_versus_full(result, full, lora))
    return result


def _what_the_full_search_finds(wider: list[Candidate], cluster: Cluster, limits: list[str]) -> str:
    """What a plan narrowed by `limits` left out: `wider`, the layouts without offload that fit without them."""
    if not wider:
        return f"without the limits ({', '.join(limits)}) nothing fits without offload either"
    return f"without the limits ({', '.join(limits)}), {len(wider)} layouts fit; the best: {wider[0].explain(cluster)}"


def _ranked(candidates: list[Candidate], cluster: Cluster) -> list[Candidate]:
    """The candidates that fit, fastest first."""
    return sorted((c for c in candidates if _fits(c, cluster)), key=lambda c: -c.time.tokens_per_gpu_s)


def _lora_versus_full(with_lora: Plan, full: Plan, lora: LoraShape) -> str:
    def verdict(p: Plan) -> str:
        if p.fits_without_offload:
            return f"{sum(not c.offloaded for c in p.ranked)} layouts fit without offload"
        return f"{len(p.ranked)} fit only with offload" if p.ranked else "nothing fits"

    return f"LoRA r={lora.r} ({', '.join(lora.target_modules)}): {verdict(with_lora)}; full fine-tuning: {verdict(full)}"


def default_global_batch(gpus: int) -> int:
    """A global batch every DP size of this cluster divides: GPUs x 4 sequences, at least 64."""
    return max(64, 4 * gpus)


def layouts(spec: ModelSpec, gpus: int, gpus_per_node: int):
    """(TP, PP) pairs megatron-core can build for this model; TP within one node."""
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= min(gpus_per_node, gpus)):
        for pp in (p for p in range(1, min(MAX_PP, spec.num_layers) + 1) if spec.num_layers % p == 0):
            if gpus % (tp * pp) == 0:
                yield tp, pp


def _zero_stages(schedule: str) -> range:
    """Under megatron-core's schedule DeepSpeed ZeRO-0 refuses the schedule's direct backward
    calls (engine.py: "Direct calls to tensor.backward() are not supported ... ZeRO stage 0"),
    so our trainer needs ZeRO >= 1 there."""
    return range(1, 4) if schedule == "megatron" else range(4)


def expert_parallel_sizes(spec: ModelSpec, setup: Setup, lora: LoraShape | None = None) -> list[int]:
    """EP sizes the recipe can run for this layout (parallel.ep, carved out of DP): powers of two
    dividing both DP and the number of experts; none but 1 for a dense model, under ZeRO-3 (DeepSpeed
    does not partition experts there) or with LoRA. Experts at expert TP 1 (biases) under TP > 1 take
    multiples of TP only (toolkit.train.build.check_expert_layout)."""
    if not spec.is_moe or setup.zero == 3 or lora is not None:
        return [1]
    powers = (1 << i for i in range(setup.dp.bit_length()))
    step = setup.tp if spec.expert_tp(setup.tp) == 1 else 1
    return [ep for ep in powers if not setup.dp % ep and not spec.num_experts % ep and not ep % step]


def context_parallel_sizes(spec: ModelSpec, seq_len: int, dp: int, lora: LoraShape | None = None,
                           dp_engine: str = "deepspeed", max_cp: int = MAX_CP) -> list[int]:
    """CP sizes the recipe can run (parallel.cp) for a long sequence: powers of two dividing `dp`
    (DeepSpeed's DP x CP) whose 2·CP chunks divide the sequence; 1 alone for a short sequence,
    where the recipe refuses CP on GPUs (sliding windows on the Transformer Engine spec, LongRoPE,
    LoRA, FSDP), and for MoE models, which the recipe runs under CP but this model does not price yet."""
    if (seq_len < CP_MIN_SEQ or spec.window_size or spec.longrope or spec.is_moe or lora is not None
            or dp_engine == "fsdp"):
        return [1]
    return [cp for cp in (1 << i for i in range(min(max_cp, MAX_CP).bit_length()))
            if not dp % cp and not seq_len % (2 * cp)]


def _candidates(spec, cluster, seq_len, global_batch, precision, schedule, allow_offload, lora=None, vpp=1,
                dp_engine="deepspeed", dpo=False, recompute=RECOMPUTE, max_cp=MAX_CP):
    fsdp = dp_engine == "fsdp"
    offloads = OFFLOADS if allow_offload and not fsdp else OFFLOADS[:1]
    zero_stages = (3,) if fsdp else _zero_stages(schedule)  # FSDP: the ZeRO-3 Setup only sizes the batch
    tp_pp = [(tp, pp) for tp, pp in layouts(spec, cluster.gpus, cluster.gpus_per_node) if pp == 1 or not fsdp]
    for (tp, pp), zero, offload, micro in itertools.product(tp_pp, zero_stages, offloads, MICRO_BATCHES):
        # DeepSpeed's view of a CP run (toolkit.train.build.ds_setup): DP x CP ranks, each CP rank's
        # share of a sequence counted as a sample
        for cp in context_parallel_sizes(spec, seq_len, cluster.gpus // (tp * pp), lora, dp_engine, max_cp):
            setup = Setup(gpus=cluster.gpus, tp=tp, pp=pp, vpp=vpp if pp > 1 else 1, zero=zero, precision=precision,
                          micro_batch=micro, global_batch=global_batch * cp, offload_optimizer=offload[0],
                          offload_param=offload[1], schedule=schedule, optimizer=OptimizerSettings())
            try:
                build(setup, spec)
            except ConfigError:
                continue
            for ep, mode in itertools.product(expert_parallel_sizes(spec, setup, lora), recompute):
                memory = estimate(spec, setup, seq_len, mode, GPU, lora=lora, ep=ep, dp_engine=dp_engine, cp=cp, dpo=dpo)
                yield Candidate(setup, mode, memory, step_time(spec, setup, seq_len, mode,
                                                               cluster.gpus_per_node, cluster.hardware, lora, cp))


def _fits(c: Candidate, cluster: Cluster) -> bool:
    if not c.memory.fits(cluster.gpu_memory):
        return False
    host = c.memory.host_bytes_per_gpu * cluster.gpus_per_node
    return cluster.host_memory_per_node is None or host <= cluster.host_memory_per_node


def _advice(spec, cluster, seq_len, global_batch, precision, schedule, result: Plan, lora=None, vpp=1,
            dpo=False, recompute=RECOMPUTE, max_cp=MAX_CP) -> list[str]:
    budget = f"{cluster.gpus} x {cluster.gpu_memory / GIB:.0f} GiB"
    if result.fits_without_offload:
        return [f"{len(result.ranked)} layouts fit in {budget}"]
    advice = [f"nothing fits in {budget} without offload"]
    if result.smallest is not None:
        s = result.smallest
        advice.append(f"the smallest layout needs {s.memory.gpu_bytes / GIB:.1f} GiB per GPU "
                      f"(TP{s.setup.tp} PP{s.setup.pp} ZeRO-{s.setup.zero}, recompute {s.recompute})")
    offloaded = [c for c in result.ranked if c.offloaded]
    if offloaded:
        host = offloaded[0].memory.host_bytes_per_gpu * cluster.gpus_per_node / GIB
        advice.append(f"offload fits: {len(offloaded)} layouts, best ZeRO-{offloaded[0].setup.zero} with "
                      f"{offloaded[0].setup.offload_optimizer}/{offloaded[0].setup.offload_param} offload "
                      f"(needs ~{host:.0f} GiB host memory per node)")
    more = _more_gpus(spec, cluster, seq_len, precision, schedule, lora, vpp, dpo=dpo, recompute=recompute, max_cp=max_cp)
    if more:
        advice.append(f"more GPUs: {more} GPUs fit without offload")
    return advice


def _more_gpus(spec, cluster, seq_len, precision, schedule, lora=None, vpp=1, dpo=False, recompute=RECOMPUTE,
               max_cp=MAX_CP) -> int | None:
    """The smallest multiple of a node that fits without offload (with the most recompute allowed)."""
    node = cluster.gpus_per_node
    for gpus in range(cluster.gpus + node, cluster.gpus * MAX_GPU_MULTIPLE + 1, node):
        bigger = Cluster(gpus, cluster.gpu_memory, node, cluster.host_memory_per_node, cluster.hardware)
        for c in _candidates(spec, bigger, seq_len, default_global_batch(gpus), precision, schedule, False, lora, vpp,
                             dpo=dpo, recompute=recompute[-1:], max_cp=max_cp):
            if c.setup.micro_batch == 1 and _fits(c, bigger):
                return gpus
    return None
