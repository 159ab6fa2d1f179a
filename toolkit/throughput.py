"""A deliberately simple step-time model, to rank layouts that fit (not to predict absolute speed).

    step = compute of the slowest stage / (1 - pipeline bubble)
           + TP all-reduces + pipeline sends + DP gradient traffic + offload

With LoRA (`lora=`) the base is frozen: its linears run no weight-gradient GEMM (2 of the 3 matmul
passes, so ~2/3 of full fine-tuning's FLOPs), and only the adapter's gradients cross DP and PCIe.

Each term is written so the ranking prefers less communication: TP inside a node (NVLink), PP
across nodes, few pipeline bubbles ((PP-1)/(VPP m+PP-1)), stages of equal work (the last one also
runs the output layer), ZeRO stages that move fewer bytes, and no offload unless needed. Ranks
are placed the way megatron-core orders them (TP innermost, then DP, then PP). Hardware numbers are named below with their source; override them through
`Hardware` for other machines.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.dsconfig import Setup
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout
from toolkit.memory.lora import LoraShape, adapter_numels
from toolkit.memory.params import stage_active_numel, total_params
from toolkit.peak_flops import H100_SXM, Peak, matmul_tflops

# Fraction of peak a large, well-shaped GEMM-bound step reaches before the terms below.
BASE_EFFICIENCY = 0.5
# Tokens per micro-batch at which GEMMs reach half of BASE_EFFICIENCY's headroom: small
# micro-batches under-fill the GPU. An assumption, tuned to rank, not measured here.
HALF_EFFICIENCY_TOKENS = 512
# NVLink 4 on H100: 450 GB/s per direction; InfiniBand NDR: 400 Gb/s = 50 GB/s per GPU.
NVLINK_BYTES_PER_S = 450e9
INFINIBAND_BYTES_PER_S = 50e9
# Host link for offload (PCIe Gen5 x16 is ~64 GB/s; ~25 GB/s sustained in practice) and the
# parameters per second DeepSpeedCPUAdam updates on one GPU's share of host cores.
PCIE_BYTES_PER_S = 25e9
CPU_ADAM_PARAMS_PER_S = 1e9
# Matmul passes per training step: forward, input gradient, weight gradient (2 FLOPs per weight
# and token each: the 6N rule); a frozen weight skips the weight gradient.
TRAINED_PASSES, FROZEN_PASSES = 3, 2
# Extra forward passes recomputation adds: full recompute runs every forward twice (Korthikanti et
# al.: 4/3 of full fine-tuning's FLOPs), selective about 2% of them.
RECOMPUTE_FORWARDS = {"none": 0.0, "selective": 0.06, "full": 1.0}


@dataclass(frozen=True)
class Hardware:
    # dense peaks per precision (toolkit.peak_flops; fp32 without TF32, torch's default); H100 SXM:
    # Megatron-Core's H100 table reports 41-48% MFU against its bf16 figure
    gpu: Peak = H100_SXM
    intra_node: float = NVLINK_BYTES_PER_S
    inter_node: float = INFINIBAND_BYTES_PER_S
    pcie: float = PCIE_BYTES_PER_S
    cpu_adam: float = CPU_ADAM_PARAMS_PER_S


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float  # fraction of the step the pipeline idles
    tp_comm: float
    dp_comm: float
    offload: float
    tokens_per_gpu_s: float

    @property
    def total(self) -> float:
        return self.compute / (1 - self.bubble) + self.tp_comm + self.dp_comm + self.offload


def step_time(spec: ModelSpec, setup: Setup, seq_len: int, recompute: str, gpus_per_node: int,
              hw: Hardware = Hardware(), lora: LoraShape | None = None, cp: int = 1) -> StepTime:
    """With `cp`, context parallelism: `setup` is DeepSpeed's view (DP x CP ranks, each CP rank's
    seq_len / CP tokens counted as a sample); attention still costs each token the whole sequence,
    and the K/V exchange over CP is added to the TP/PP communication."""
    local = seq_len // cp
    tokens = setup.samples_per_step * local
    flops = tokens * setup.pp * _slowest_stage_flops_per_token(spec, setup, seq_len, recompute, lora)
    micro_tokens = setup.micro_batch * local
    efficiency = BASE_EFFICIENCY * micro_tokens / (micro_tokens + HALF_EFFICIENCY_TOKENS)
    # precision=fp8 is timed as bf16: its speed-up (the decoder GEMMs only, less the casts) is what a GPU
    # run shows (benchmarks/gpu_suite.py's fp8 stage), not a datasheet ratio the planner could assume
    precision = "bf16" if setup.precision == "fp8" else setup.precision
    compute = flops / (setup.gpus * matmul_tflops(hw.gpu, precision, tf32=False) * 1e12 * efficiency)
    m = setup.micro_batches
    bubble = (setup.pp - 1) / (setup.vpp * m + setup.pp - 1)  # interleaving divides the bubble by VPP
    n = total_params(spec)
    trained = n if lora is None else sum(adapter_numels(spec, lora, 1, 1))
    comm = (_tp_comm(spec, setup, local, hw, gpus_per_node) + _cp_comm(spec, setup, local, cp, hw),
            _pp_comm(spec, setup, local, hw, gpus_per_node), _dp_comm(n, trained, setup, hw, gpus_per_node))
    offload = _offload(n, trained, setup, hw)
    step = StepTime(compute, bubble, comm[0] + comm[1], comm[2], offload, 0.0)
    return StepTime(compute, bubble, comm[0] + comm[1], comm[2], offload, tokens / step.total / setup.gpus)


def _slowest_stage_flops_per_token(spec, setup, seq_len, recompute="none", lora=None) -> float:
    """6 x the matmul parameters of a stage a token goes through (the embedding is a lookup; of a
    Mixture-of-Experts layer's routed experts, the top-k) plus causal attention
    (torchtitan's 6*L*h*s, halved for causality); the pipeline runs at its slowest stage. Under
    LoRA the base's matmuls make 2 passes instead of 3 and the adapter's make 3; attention has no
    weights, so its backward is unchanged. Recompute adds forward passes of everything."""
    lookup = Layout(setup.tp, setup.pp).padded_vocab(spec.vocab_size) * spec.hidden_size
    layers = spec.num_layers // setup.pp
    stages = (0, setup.pp - 1)
    matmul = max(stage_active_numel(spec, setup.tp, setup.pp, s) - (s == 0) * lookup for s in stages)
    extra = RECOMPUTE_FORWARDS[recompute]
    attention = 6 * layers * spec.hidden_size * seq_len * (TRAINED_PASSES + extra) / TRAINED_PASSES
    if lora is None:
        return 2 * matmul * (TRAINED_PASSES + extra) + attention
    adapter = sum(adapter_numels(spec, lora, 1, setup.pp))
    return 2 * matmul * (FROZEN_PASSES + extra) + 2 * adapter * (TRAINED_PASSES + extra) + attention


def _bytes(setup: Setup) -> int:
    return 4 if setup.precision == "fp32" else 2


def _cp_comm(spec, setup, local: int, cp: int, hw) -> float:
    """Each layer's K and V of the other CP ranks received in forward, and their gradients sent back
    in backward, per micro-batch (CP groups span nodes at worst: the inter-node bandwidth)."""
    if cp == 1:
        return 0.0
    kv = 2 * spec.num_kv_heads * spec.head_dim // setup.tp
    per_micro = 2 * spec.num_layers // setup.pp * setup.micro_batch * local * kv * (cp - 1) * _bytes(setup)
    return setup.micro_batches * per_micro / hw.inter_node


def _tp_comm(spec, setup, seq_len, hw, gpus_per_node) -> float:
    """Two all-reduces of the [s, b, h] activations per layer forward and two backward."""
    if setup.tp == 1:
        return 0.0
    bandwidth = hw.intra_node if setup.tp <= gpus_per_node else hw.inter_node
    ring = 2 * (setup.tp - 1) / setup.tp
    per_layer = 4 * ring * setup.micro_batch * seq_len * spec.hidden_size * _bytes(setup)
    return per_layer * spec.num_layers / setup.pp * setup.micro_batches / bandwidth


def _pp_comm(spec, setup, seq_len, hw, gpus_per_node) -> float:
    """Each micro-batch's activations go forward and their gradients back across a stage boundary,
    once per virtual stage with interleaving (VPP x the transfers of 1F1B)."""
    if setup.pp == 1:
        return 0.0
    inside = setup.gpus <= gpus_per_node
    size = setup.micro_batch * seq_len * spec.hidden_size * _bytes(setup)
    return 2 * setup.vpp * setup.micro_batches * size / (hw.intra_node if inside else hw.inter_node)


def _dp_comm(n, trained, setup, hw, gpus_per_node) -> float:
    """ZeRO paper §7: ZeRO-0/1/2 move 2 x the local trained parameters per step (gradients
    reduced, updated parameters gathered), ZeRO-3 also gathers every parameter twice (forward and
    backward) and reduces the gradients once. A DP group spans TP x DP consecutive ranks."""
    if setup.dp == 1:
        return 0.0
    moved = 2 * n + trained if setup.zero == 3 else 2 * trained
    volume = moved * (setup.dp - 1) / setup.dp / (setup.tp * setup.pp) * _bytes(setup)
    inside = setup.tp * setup.dp <= gpus_per_node
    return volume / (hw.intra_node if inside else hw.inter_node)


def _offload(n, trained, setup, hw) -> float:
    """Gradients down and parameters up over PCIe, the Adam step on host cores (the trained
    parameters only); with parameter offload, every parameter also crosses PCIe for every forward
    and backward."""
    local, local_trained = (x / (setup.tp * setup.pp * setup.dp) for x in (n, trained))
    t = 0.0
    if setup.offload_optimizer != "none":
        t += local_trained * (4 + _bytes(setup)) / hw.pcie + local_trained / hw.cpu_adam
    if setup.offload_param != "none":
        t += 2 * setup.micro_batches * local * _bytes(setup) / hw.pcie
    return t
