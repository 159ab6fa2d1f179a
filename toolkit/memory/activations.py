"""Activation memory: the bytes a transformer layer keeps for backward, per micro-batch.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2) count sbh(34 + 5as/h) per GPT layer: LayerNorm, a 4h GELU MLP, dropout masks and the
s^2 attention scores. Our models differ, term by term:
  RMSNorm instead of LayerNorm      the norm keeps its input and an fp32 1/rms per token
  SwiGLU with ffn f                 fc1 output is 2f wide; the glu output feeds fc2
  GQA                               k and v are kv = groups x head_dim wide, not h
  q/k norms (Qwen3 qk_layernorm)    a norm over q and k per head, one 1/rms per token and head
  no dropout                        no masks (their 5as/h term's mask and 2sbh of masks)
  fused attention                   no s^2 terms: q, k, v, output and an fp32 log-sum-exp (the local
                                    spec's SDPA keeps k and v repeated to every query head; attention
                                    sinks and multi-latent attention stay unfused, with s^2 scores)
Which tensors are kept depends on the kernels, so each term is switchable (`Kernels`). The CPU
profile (megatron-core's local spec: torch's composite rms_norm and unfused glu, torch's SDPA) is
validated against torch.autograd.graph.saved_tensors_hooks byte counts in
tests/test_memory_measured.py; the GPU profile follows the same terms with the fused kernels'
saved tensors (Transformer Engine: fused RMSNorm saves input + rsigma, flash attention saves
q, k, v, output + softmax LSE, fused SwiGLU saves its input) and is not measured here.

Sequence parallelism (Korthikanti et al. §4.2.2) splits over TP what TP alone leaves whole: the
norms (input and output), the inputs the column-parallel linears keep (megatron-core saves the
rank's sequence shard and gathers it again in backward, tensor_parallel/layers.py) and the layer
input full recompute keeps. Attention and MLP internals are split by TP already; the RoPE tables,
the causal mask and the logits (the output layer gathers the sequence) stay whole. Measured at
TP 2 in tests/test_memory_measured.py too.

Context parallelism (parallel.cp, toolkit/blocks/context_parallel.py) gives each rank seq / CP tokens:
every per-token term is divided by CP. Attention is not: each rank's queries see the whole
sequence's keys. The local spec's CP attention all-gathers K and V, so its SDPA keeps k and v
(repeated per query head) over the whole sequence and the [s/CP, s] mask; TE's ring
(GPU) keeps only its own q, k, v, output and LSE, and two K/V blocks in flight (temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.families import family_named
from toolkit.families.spec import ModelSpec

FP32 = 4
INT64 = 8
BOOL = 1
# Cross entropy (megatron-core VocabParallelCrossEntropy) keeps a bool target mask and int64
# masked targets per token.
CE_PER_TOKEN = BOOL + INT64


@dataclass(frozen=True)
class Kernels:
    name: str
    fused_norm: bool  # saves input + fp32 rstd; torch's composite rms_norm keeps two fp32 copies instead
    flash_attention: bool  # Transformer Engine's; else the local spec's (runs_sdpa: SDPA, or unfused with s^2 terms)
    fused_swiglu: bool  # else megatron's unfused glu also keeps silu(x) and (x_linear + offset)


GPU = Kernels("gpu: Transformer Engine (fused RMSNorm, flash attention, fused SwiGLU)", True, True, True)
CPU_LOCAL = Kernels("cpu: megatron-core local spec (torch rms_norm, SDPA attention, unfused glu)", False, False, False)

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Shape:
    """One micro-batch through one TP rank: tokens, widths already divided by TP."""

    seq: int
    batch: int
    tp: int
    act_bytes: int
    sequence_parallel: bool = False
    cp: int = 1  # context parallelism: this rank holds seq / CP of each sequence
    # bytes per element of the inputs the linears keep for backward, where not act_bytes: 1 under
    # precision=fp8 on Transformer Engine, which keeps them quantized (toolkit.memory.estimate.FP8_BYTES)
    linear_input_bytes: int | None = None

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp

    @property
    def tokens(self) -> int:
        return self.local_seq * self.batch

    def hidden_tokens(self, spec: ModelSpec) -> int:
        """Elements of one [s, b, h] tensor on this rank (sequence-sharded under SP)."""
        return self.tokens * spec.hidden_size // (self.tp if self.sequence_parallel else 1)


def layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str = "none") -> int:
    """Bytes one layer keeps for backward for one micro-batch."""
    if recompute == "full":
        return shape.act_bytes * shape.hidden_tokens(spec)  # only the checkpointed layer input
    if spec.mla:
        return mla_layer_bytes(spec, shape, kernels, recompute)
    attention = _selective_attention(spec, shape, kernels) if recompute == "selective" else _attention(spec, shape, kernels)
    norms = 2 * _norm(spec, shape, kernels) + _qk_norms(spec, shape, kernels)
    mlp = _moe(spec, shape, kernels) if spec.is_moe else _swiglu(spec, shape, kernels)
    return norms + _linear_inputs(spec, shape) + attention + mlp


# fla's chunked gated delta rule works on chunks of 64 tokens: one [d_k, d_v] state per head and chunk, and
# the chunk's [64] WY weights per token and head (fla/ops/gated_delta_rule/chunk.py)
GDN_CHUNK = 64


def gated_delta_net_layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str = "none") -> int:
    """Bytes a gated delta net (linear attention) layer keeps for backward for one micro-batch, modelled on
    megatron-core's GatedDeltaNet with fla's chunked kernel (gated_delta_net.py:280-421): no s^2 scores, but
    the input norm; in_proj's input and its output [q; k; v; z; beta; alpha]; conv1d's output and its silu
    (q, k, v channels); the l2-normed q, k; g and beta in fp32; one [d_k, d_v] state per value head and
    chunk of 64 tokens and the chunk's WY weights (fp32); the gated norm's input, gate and output; out_proj's
    input. Heads split over TP; the MLP as any layer's. Not measured (the CPU path runs the token-at-a-time
    torch rule, toolkit/blocks/kernels/gated_delta_rule.py, which keeps a state per token instead)."""
    if recompute == "full":
        return shape.act_bytes * shape.hidden_tokens(spec)
    la, t, b = spec.linear_attention, shape.tokens, shape.act_bytes
    qk, v, heads = la["k_heads"] * la["k_dim"], la["v_heads"] * la["v_dim"], la["v_heads"] // shape.tp
    projected = t * (2 * qk + 2 * v + 2 * la["v_heads"]) // shape.tp
    conv = 2 * t * (2 * qk + v) // shape.tp
    chunks = shape.batch * -(-shape.local_seq // GDN_CHUNK)
    rule = b * t * 2 * qk // shape.tp + FP32 * t * heads * (2 + GDN_CHUNK) + b * chunks * heads * la["k_dim"] * la["v_dim"]
    gated_norm = 3 * b * t * v // shape.tp
    mlp = _moe(spec, shape, kernels) if spec.is_moe else _swiglu(spec, shape, kernels)
    linear_inputs = b * (2 * shape.hidden_tokens(spec) + t * v // shape.tp)  # the norms' outputs (in_proj's, the MLP's inputs), out_proj's
    return 2 * _norm(spec, shape, kernels) + linear_inputs + b * (projected + conv) + rule + gated_norm + mlp


def mamba_layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    """Bytes a Mamba-2 layer (Nemotron-H's M) keeps for backward for one micro-batch, modelled on megatron-core's
    MambaMixer with mamba_ssm's chunked scan (ssm/mamba_mixer.py, the training path): the input norm; in_proj's
    input and its output [z; x; B; C; dt]; conv1d's output and its silu (x, B, C channels); dt and A dt's cumulative
    sum per chunk in fp32 and one [head_dim, state] fp32 state per head and chunk; the scan's output, the gated
    norm's (out_proj's input) and its fp32 rstd per group. Heads and groups split over TP. Not measured (the CPU
    path runs the torch scan, toolkit/blocks/kernels/mamba2_ssd.py)."""
    m, t, b = spec.mamba, shape.tokens, shape.act_bytes
    inner, bc, heads = m["heads"] * m["head_dim"], 2 * m["groups"] * m["state"], m["heads"] // shape.tp
    projected = t * (2 * inner + bc + m["heads"]) // shape.tp
    conv = 2 * t * (inner + bc) // shape.tp
    chunks = shape.batch * -(-shape.local_seq // m["chunk_size"])
    scan = FP32 * (2 * t * heads + chunks * heads * m["head_dim"] * m["state"])
    gated_norm = 2 * b * t * inner // shape.tp + FP32 * t * m["groups"] // shape.tp
    return _norm(spec, shape, kernels) + b * (shape.hidden_tokens(spec) + projected + conv) + scan + gated_norm


def hybrid_layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str, symbol: str) -> int:
    """Bytes one layer of a hybrid pattern keeps (ModelSpec.hybrid_pattern): M a Mamba-2 layer, * attention alone
    (its norm, linear_qkv's and linear_proj's inputs, the core attention), - a relu^2 MLP alone (its norm,
    linear_fc1's input, fc1's output and its relu, whose square is linear_fc2's input), E a Mixture-of-Experts layer
    alone (its norm and a MoE layer's MLP half, _moe; not measured on Nemotron 3)."""
    if recompute == "full":
        return shape.act_bytes * shape.hidden_tokens(spec)
    b, t = shape.act_bytes, shape.tokens
    linear = shape.linear_input_bytes or b
    if symbol == "M":
        return mamba_layer_bytes(spec, shape, kernels)
    if symbol == "E":
        return _norm(spec, shape, kernels) + _moe(spec, shape, kernels)
    if symbol == "*":
        attention = _selective_attention(spec, shape, kernels) if recompute == "selective" else _attention(spec, shape, kernels)
        q = spec.num_heads * spec.head_dim
        return _norm(spec, shape, kernels) + linear * (shape.hidden_tokens(spec) + t * q // shape.tp) + attention
    f = spec.ffn_hidden_size // shape.tp
    return _norm(spec, shape, kernels) + linear * (shape.hidden_tokens(spec) + t * f) + 2 * b * t * f


def stage_layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str, layers: range) -> int:
    """Bytes the layers `layers` keep per layer on average: Qwen3-Next's gated delta net layers and attention
    layers keep different activations (ModelSpec.linear_layers), and so do a hybrid pattern's Mamba-2,
    attention and MLP layers; any other model's layers the same."""
    if not spec.linear_layers:
        return layer_bytes(spec, shape, kernels, recompute)
    if spec.hybrid_pattern:
        total = sum(hybrid_layer_bytes(spec, shape, kernels, recompute, spec.hybrid_pattern[n]) for n in layers)
        return -(-total // len(layers))
    linear = sum(spec.linear_layers[n] == "1" for n in layers)
    total = (linear * gated_delta_net_layer_bytes(spec, shape, kernels, recompute)
             + (len(layers) - linear) * layer_bytes(spec, shape, kernels, recompute))
    return -(-total // len(layers))


def recompute_working_set(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str) -> int:
    """With full recompute, backward rebuilds one layer's activations at a time (a hybrid pattern's largest)."""
    if recompute != "full":
        return 0
    if spec.hybrid_pattern:
        return max(hybrid_layer_bytes(spec, shape, kernels, "none", symbol) for symbol in set(spec.hybrid_pattern))
    return layer_bytes(spec, shape, kernels)


def _norm(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    elements = shape.hidden_tokens(spec)
    rstd = FP32 * elements // spec.hidden_size
    return (shape.act_bytes if kernels.fused_norm else 2 * FP32) * elements + rstd


def _qk_norms(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    """The per-head q and k norms of a qk_layernorm family keep what the layer norms keep, over
    q and k's widths; in fp32 torch's composite norm also keeps its input (q and k reshaped out of
    the fused qkv output), which in bf16 its first op, the cast to fp32, does not need."""
    if not family_named(spec.family).megatron.get("qk_layernorm"):
        return 0
    elements = shape.tokens * (spec.num_heads + spec.num_kv_heads) * spec.head_dim // shape.tp
    rstd = FP32 * elements // spec.head_dim
    if kernels.fused_norm:
        return shape.act_bytes * elements + rstd
    kept_input = FP32 * elements if shape.act_bytes == FP32 else 0
    return (2 * FP32 * elements) + kept_input + rstd


def _linear_inputs(spec: ModelSpec, shape: Shape) -> int:
    """Inputs kept by linear_qkv and linear_fc1 (the norm outputs), linear_proj and linear_fc2."""
    q, f = spec.num_heads * spec.head_dim, 0 if spec.is_moe else spec.ffn_hidden_size  # MoE: in _moe
    sharded = shape.tokens * (q + f) // shape.tp
    return (shape.linear_input_bytes or shape.act_bytes) * (2 * shape.hidden_tokens(spec) + sharded)


def _attention(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    heads, q, kv = spec.num_heads // shape.tp, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    t, b = shape.tokens, shape.act_bytes
    rope = 4 * shape.local_seq * spec.rotary_dim * b  # cos and sin for q and k, over the rotated dims only
    if kernels.flash_attention:
        lse = FP32 * heads * t
        return b * t * (2 * q + 2 * kv) // shape.tp + lse + rope
    if runs_sdpa(spec):
        # the local spec's SdpaAttention: q, k and v repeated to every query head (under CP over the whole
        # gathered sequence) and an fp32 log-sum-exp (its output is linear_proj's input: the kernel writes it
        # in q's [s, b, heads, dim] layout, so the reshape is a view); under CP the [s/CP, s] mask, which the
        # kernel keeps in the activation dtype
        mask = b * shape.local_seq * shape.seq if shape.cp > 1 else 0
        return b * t * (1 + 2 * shape.cp) * q // shape.tp + FP32 * heads * t + mask + rope
    # megatron-core's DotProductAttention (attention sinks): q and k, v repeated to every query head (GQA; under CP over the whole gathered sequence), fp32
    # softmax, the probabilities cast back for the second matmul (the same tensor in fp32), and the mask.
    scores = heads * shape.batch * shape.local_seq * shape.seq
    probs = b * scores if b != FP32 else 0
    return b * t * (1 + 2 * shape.cp) * q // shape.tp + FP32 * scores + probs + BOOL * shape.local_seq * shape.seq + rope


def _selective_attention(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    """Core attention recomputed: its inputs are kept, q and k after RoPE plus v, a view that
    keeps the whole fused qkv output alive."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    kept = shape.act_bytes * shape.tokens * (q + kv + (q + 2 * kv)) // shape.tp
    mask = 0 if kernels.flash_attention or runs_sdpa(spec) else BOOL * shape.local_seq * shape.seq
    return kept + mask


def runs_sdpa(spec: ModelSpec) -> bool:
    """Whether the local spec's attention runs torch's fused SDPA (toolkit/blocks/attention_sdpa.py) for this
    model: every model but those with attention sinks (gpt-oss), which megatron-core's
    DotProductAttention computes unfused. Multi-latent attention has its own (mla_layer_bytes)."""
    return not spec.attention_sinks


def _swiglu(spec: ModelSpec, shape: Shape, kernels: Kernels, ffn: int | None = None) -> int:
    f = (spec.ffn_hidden_size if ffn is None else ffn) // shape.tp
    widths = 2 * f if kernels.fused_swiglu else 4 * f  # fc1 output (+ silu(x), x_linear + offset)
    return shape.act_bytes * shape.tokens * widths


def _moe(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    """An MoE layer's MLP under the alltoall dispatcher, for one micro-batch. The router keeps
    its logits, fp32 probabilities and top-k, the routing map and the permutation indices, for the
    tokens it routes: the rank's sequence shard under sequence parallelism. Every token goes to
    top-k experts, so the experts see tokens x k rows (on average over EP ranks, whatever EP is;
    under SP the dispatcher gathers the TP group's routed rows again, token_dispatcher.py:696, and
    each rank runs its 1/TP share of every expert's width on all of them): the dispatched hidden
    states (the experts' fc1 inputs, one sorted copy), the SwiGLU terms, fc2's input and the
    probability-weighted intermediate. A shared expert is a dense MLP of its width. Measured at
    EP 1 and at TP 2 with SP (EP 1 and 2) in tests/test_memory_measured.py."""
    t, k, b, f = shape.tokens, spec.moe_topk, shape.act_bytes, spec.moe_ffn_hidden_size // shape.tp
    routed_rows, here = t * k, _routed_tokens(shape)  # rows the experts see; tokens this rank's router sees
    router = 2 * FP32 * here * spec.num_experts + FP32 * here * k  # fp32 logits and probabilities, top-k
    indices = BOOL * here * spec.num_experts + INT64 * here * k  # routing map, permutation
    experts = b * routed_rows * (spec.hidden_size + 2 * f) + _swiglu(spec, shape, kernels, spec.moe_ffn_hidden_size) * k
    shared = 0
    if spec.moe_shared_ffn_hidden_size:
        fs = spec.moe_shared_ffn_hidden_size // shape.tp
        shared = b * t * fs + _swiglu(spec, shape, kernels, spec.moe_shared_ffn_hidden_size)
    return shape.act_bytes * shape.hidden_tokens(spec) + router + indices + experts + shared


def _routed_tokens(shape: Shape) -> int:
    """The tokens this rank's routers see: its sequence shard under sequence parallelism."""
    return shape.tokens // (shape.tp if shape.sequence_parallel else 1)


def dispatcher_buffers(spec: ModelSpec, shape: Shape) -> int:
    """The alltoall dispatcher's transient copies of the routed tokens, not kept for backward:
    the permuted local tokens and the all-to-all's receive buffer (the routed tokens x k hidden
    states each, before the gather over TP under SP), alive during the dispatch and again, as
    gradients, during its backward."""
    return 2 * shape.act_bytes * _routed_tokens(shape) * spec.moe_topk * spec.hidden_size if spec.is_moe else 0


def first_stage_bytes(shape: Shape) -> int:
    """The embedding keeps the token ids."""
    return INT64 * shape.tokens


def last_stage_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, padded_vocab: int) -> int:
    """Final norm, output-layer input and the cross entropy's fp32 softmax over the vocab shard."""
    logits = FP32 * shape.tokens * padded_vocab // shape.tp
    return _norm(spec, shape, kernels) + shape.act_bytes * shape.hidden_tokens(spec) + logits + CE_PER_TOKEN * shape.tokens


def logits_temporary(shape: Shape, padded_vocab: int) -> int:
    """The 16-bit logits before the loss casts them to fp32 (and their gradient after)."""
    return shape.act_bytes * shape.tokens * padded_vocab // shape.tp if shape.act_bytes != FP32 else 0


def attention_buffer(spec: ModelSpec, shape: Shape, kernels: Kernels) -> int:
    """Unfused attention reuses one global [b*heads, s, s] buffer for the QK^T product ([s/CP, s]
    under CP, with the gathered K and V); SDPA needs none, but the gathered K and V under CP; TE's CP
    ring holds two K/V blocks (sending, receiving)."""
    if kernels.flash_attention:
        kv = spec.num_kv_heads * spec.head_dim
        return 2 * shape.act_bytes * shape.tokens * 2 * kv // shape.tp if shape.cp > 1 else 0
    gathered = 2 * shape.act_bytes * shape.batch * shape.seq * spec.num_kv_heads * spec.head_dim // shape.tp
    if runs_sdpa(spec):
        return gathered if shape.cp > 1 else 0
    return shape.act_bytes * shape.batch * spec.num_heads // shape.tp * shape.local_seq * shape.seq + \
        (gathered if shape.cp > 1 else 0)


def local_kernels_for(spec: ModelSpec, kernels: Kernels) -> Kernels:
    """The kernels a model runs with: multi-latent attention runs megatron-core's local spec on every
    device (its checkpoints are converted for it only: toolkit/families/mla.py), so its attention is
    unfused and its norms are torch's whatever the device; the fused SwiGLU stays (a torch function)."""
    if not spec.mla or kernels == CPU_LOCAL:
        return kernels
    return Kernels(kernels.name + "; multi-latent attention on megatron-core's local spec (unfused attention, "
                   "torch rms_norm)", False, False, kernels.fused_swiglu)


def mla_layer_bytes(spec: ModelSpec, shape: Shape, kernels: Kernels, recompute: str) -> int:
    """A multi-latent attention layer (megatron-core's MLASelfAttention, local spec) and its MLP. Per
    token: the input norm and the linears' inputs as any layer; the low-rank latents (q_lora_rank where
    the query is low-rank, kv_lora_rank), each through a torch RMSNorm into its up projection, whole on
    every TP rank (the down projections' outputs are gathered over TP); cos and sin over the
    qk_pos_emb_head_dim rotated dimensions; core attention (unfused) on q and k of heads x (qk_head_dim +
    qk_pos_emb_head_dim), both new tensors (the rotated part concatenated), and v of heads x v_head_dim,
    with the fp32 scores, the probabilities and the mask; linear_proj's input, heads x v_head_dim.
    Measured against saved tensors in tests/test_memory_measured.py."""
    m, b, t, tp = spec.mla, shape.act_bytes, shape.tokens, shape.tp
    heads = spec.num_heads // tp
    qk, v = heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), heads * m["v_head_dim"]
    latents = [w for w in (m["q_lora_rank"], m["kv_lora_rank"]) if w]
    norms = 2 * _norm(spec, shape, kernels) + sum(_latent_norm(w, shape, kernels) for w in latents)
    linear_inputs = b * (2 * shape.hidden_tokens(spec) + t * (sum(latents) + v + (0 if spec.is_moe else
                                                                                    spec.ffn_hidden_size // tp)))
    rope = 4 * shape.local_seq * m["qk_rope_head_dim"] * b  # cos and sin for q and k
    scores = heads * shape.batch * shape.local_seq * shape.seq
    core = b * t * (2 * qk + v) + BOOL * shape.local_seq * shape.seq  # what selective recompute keeps
    if recompute != "selective":
        core += FP32 * scores + (b * scores if b != FP32 else 0)
    mlp = _moe(spec, shape, kernels) if spec.is_moe else _swiglu(spec, shape, kernels)
    return norms + linear_inputs + rope + core + mlp


def _latent_norm(width: int, shape: Shape, kernels: Kernels) -> int:
    """An RMSNorm over a latent of `width`, whole on every TP rank: as _norm keeps, per element and per token."""
    elements = shape.tokens * width
    return (shape.act_bytes if kernels.fused_norm else 2 * FP32) * elements + FP32 * shape.tokens
