"""Make megatron-core 0.16.x run on a CPU-only torch build (gloo backend).

`apply()` is a no-op when CUDA is available (except `apply_upstream_fixes`, which
toolkit.runtime.distributed runs on every device), and idempotent. Each patch below names the
upstream spot (megatron-core 0.16.1 file:line) it works around; each was shown necessary by
disabling it and re-running a TP2 x PP2 forward/backward (../shared/reference/cpu_megatron_core.md §1).

    UPSTREAM_SPOTS[name] -> what upstream does that fails without CUDA

`torch.cuda.is_available()` and `device_count()` are deliberately left alone: DeepSpeed picks its
accelerator from them (deepspeed/accelerator/real_accelerator.py:205).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch.overrides import TorchFunctionMode

UPSTREAM_SPOTS = {
    "current_device": "~90 uses of device=torch.cuda.current_device(), first in "
    "models/common/embeddings/rotary_pos_embedding.py:162, tensor_parallel/mappings.py:91, "
    "pipeline_parallel/p2p_communication.py:313, dist_checkpointing/strategies/state_dict_saver.py:252",
    "synchronize": "torch.cuda.synchronize() in pipeline_parallel/p2p_communication.py:398 (every PP "
    "send/recv), parallel_state.py:198, dist_checkpointing/strategies/fully_parallel.py:272",
    "rng": "tensor_parallel/random.py:55/72-111/235: the model-parallel RNG tracker stores CUDA "
    "generator states (used by dropout forks and activation recompute)",
    "causal_mask": "transformer/utils.py:35/40 build the default causal and sliding-window masks with "
    "device='cuda'; imported by name into fusions/fused_softmax.py:8",
    "schedules": "pipeline_parallel/schedules.py:596/983/2138: torch.zeros(..., device='cuda') for the "
    "token count in every forward_backward_* schedule",
    "dist_ckpt": "dist_checkpointing/exchange_utils.py:98-110/326/336/499 (.cuda(), device='cuda') via "
    "strategies/fully_parallel.py:258, and strategies/state_dict_saver.py:204",
    "tied_embeddings": "models/common/language_module/language_module.py:244: "
    "setup_embeddings_and_output_layer() moves the shared embedding with .cuda() before the "
    "first/last-stage all-reduce (tied embeddings with PP > 1; not in the reference's six spots)",
    "moe_dispatcher_stream": "transformer/moe/token_dispatcher.py:445: MoEAlltoAllTokenDispatcher.__init__ makes "
    "a torch.cuda.Stream(); :862-899 _maybe_dtoh_and_synchronize copies the split sizes to the host on it "
    "and turns them into numpy arrays (moe_utils.py:1093 skips CPU tensors, so they stay tensors, which "
    "ProcessGroup.all_to_all_single rejects via tensor_parallel/mappings.py:444)",
    "distributed_optimizer": "optimizer/optimizer.py:473/481/485: MixedPrecisionOptimizer.__init__ makes its "
    "found-inf, overflow and unit-scale tensors with device='cuda'; optimizer/distrib_optimizer.py:361/420: "
    "DistributedOptimizer accepts parameters only by their CUDA type names (model_param.type() == "
    "'torch.cuda.FloatTensor', else TypeError); optimizer/clip_grads.py:103 (get_grad_norm_fp32, from "
    "ChainedOptimizer.step) makes its norm tensor with device='cuda'; distrib_optimizer.py:1089: get_parameter_state_dp_zero (saving the fully_reshardable format) calls .cuda(); 0.19: "
    "distributed/param_and_grad_buffer.py:632 _ParamAndGradBucketGroup.start_grad_sync waits on torch.cuda.current_stream(). Needed only to build and step "
    "megatron-core's own DistributedOptimizer (the test that reads its checkpoints); our trainer uses DeepSpeed's",
    "context_parallel_rope": "models/common/embeddings/rope_utils.py:62-64: get_pos_emb_on_this_cp_rank (each CP "
    "rank's RoPE chunks) builds its index with pin_memory=True and .cuda(); imported by name into "
    "rotary_pos_embedding.py:26 and yarn_rotary_pos_embedding.py:13",
    "uneven_gather": "tensor_parallel/mappings.py:150: _gather_along_first_dim with output_split_sizes is a list "
    "all_gather of unequal tensors, which gloo refuses; the MoE alltoall dispatcher calls it over the "
    "expert-TP group (token_dispatcher.py:696) when expert TP > 1",
    "gated_delta_rule": "ssm/gated_delta_net.py:39-47 (0.19: ssm/gated_delta_net/common.py:44-54, imported by name "
    "into gdn.py:18-27; megatron_versions.gated_delta_net_modules) imports l2norm and chunk_gated_delta_rule "
    "(from 0.18 also causal_conv1d, the depthwise conv) from `fla` "
    "(flash-linear-attention's Triton kernels), :103-106 refuses to build GatedDeltaNet without them and "
    ":349-350/:382 call them (Qwen3-Next's linear-attention layers). Stood in by toolkit/blocks/kernels/gated_delta_rule.py "
    "wherever `fla` is missing, on GPUs too (apply_upstream_fixes). The causal conv needs no stand-in: without "
    "`causal_conv1d` upstream runs its own nn.Conv1d and activation (:49-53, :326-327)",
}
# Applied on every machine, GPUs included (apply_upstream_fixes): an upstream bug, not a CPU one.
TE_GEMM_SPOT = ("transformer/moe/moe_utils.py:22-39 imports te_general_gemm only inside `try: import "
                "transformer_engine`; RouterGatingLinearFunction reads it at :1192/:1225 (NameError without TE)")

EXPERT_BIAS_MASK_SPOT = ("transformer/moe/router.py:541-542: TopKRouter._apply_expert_bias (the expert bias's token "
                         "counts, DeepSeek-V3 / GLM-4.5) does routing_map [tokens, experts] & ~padding_mask [tokens], "
                         "which cannot broadcast: every training forward with a padding mask fails (upstream issue "
                         "NVIDIA/Megatron-LM#6111, fixed by #6114 after 0.16.1)")

# Not a failure but a cost: applied with the CPU patches (apply), on a machine without CUDA only.
EAGER_FUSIONS_SPOT = ("jit.py:16-22: jit_fuser is torch.compile from torch 2.2, on the fused helpers of "
                      "fusions/fused_bias_swiglu.py, fused_bias_gelu.py, fused_bias_dropout.py, transformer/torch_norm.py "
                      "(L2Norm), ssm/gated_delta_net/common.py and transformer/moe/router.py. On CPU, inductor compiles C++ for "
                      "each of them in every process, for every new shape: 2,752 of 10,546 py-spy samples (26%) of the "
                      "verify launch over the published corpus, where gated delta nets, GLU MLPs, L2 norms and routers "
                      "compile (docs/benchmarks.md, 'CPU launches'). Eager is what they compute uncompiled")

# Stood in only while a model is built, by the module named (not patched here); listed so that every
# upstream spot the toolkit works around is found in one place.
MODEL_BUILD_SPOTS = {
    "toolkit/blocks/mixer_mamba.py mamba_mixer_spec (every device, without mamba_ssm)": "ssm/mamba_mixer.py:68-93 "
    "(0.19.2; 0.16.1 :59-71) imports mamba_chunk_scan_combined, "
    "mamba_split_conv1d_scan_combined and RMSNormGated from `mamba_ssm` (Triton kernels), else sets "
    "HAVE_MAMBA_SSM False, RMSNormGated a MagicMock and so ExtendedRMSNorm (:111; 0.16.1 :83) a MagicMock; "
    "MambaMixer.__init__ refuses to build without it (:202; 0.16.1 :173), _ssm_training calls the split "
    "kernel (:755; 0.16.1 :659) and _ssm_prefill the chunk scan (:1063; 0.16.1 :850) (Nemotron-H's Mamba-2 "
    "layers). Stood in by toolkit/blocks/kernels/mamba2_ssd.py and toolkit/blocks/norms.py "
    "ExtendedRMSNorm wherever `mamba_ssm` is missing, on GPUs too. The causal conv of "
    "the prefill path needs none: without `causal_conv1d` upstream runs its own conv and silu (:914; 0.16.1 :802)",
    "toolkit/blocks/rope_yarn.py CpuYarnRotaryEmbedding (without CUDA)": "models/common/embeddings/yarn_rotary_pos_embedding.py:"
    "120-126: YarnRotaryEmbedding.get_emb moves its frequencies to torch.cuda.current_device(), and its "
    "constructor calls it: MLA with YaRN cannot be built without CUDA",
    "toolkit/blocks/attention_mla.py buildable_mla (without TE)": "transformer/multi_latent_attention.py:54-62/184-185: "
    "TE's MagicMock TELinear reads as HAVE_TE, then isinstance(self.linear_proj, TELinear) raises TypeError",
    "toolkit/blocks/attention_mla.py MLACoreAttention (local spec)": "transformer/multi_latent_attention.py:154-164 pass "
    "k_channels / v_channels, which the local DotProductAttention (dot_product_attention.py:42-52) does not take",
    "toolkit/blocks/hybrid_spec.py buildable_hybrid_stack (without TE)": "models/hybrid/hybrid_block.py:215 (0.16.1 "
    "ssm/mamba_block.py:166): HybridStack builds its final norm as TENorm by name, whatever the spec, and TENorm raises "
    "ImportError without Transformer Engine (extensions/transformer_engine.py:818): the hybrid model (Nemotron-H) "
    "cannot be built without TE",
    "toolkit/blocks/attention_mla.py sum_latent_grads_over_tp (every device, TP > 1, local spec)": "transformer/"
    "multi_latent_attention.py:594/607 gather the latent whose backward keeps a partial gradient (mappings.py:487)",
}

APPLIED: list[str] = []
_log = logging.getLogger(__name__)


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Scoped: rewrite device='cuda' to cpu in factory calls and make Tensor.cuda() a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):  # pinned host memory needs CUDA, and is only for host-to-GPU copies
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


class _CudaFactoriesAndTypeNames(_CudaFactoriesOnCpu):
    """Scoped, as _CudaFactoriesOnCpu, and Tensor.type() answers with the CUDA type name
    ('torch.cuda.FloatTensor' for a CPU float tensor), which is what upstream checks for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return super().__torch_function__(func, types, args, kwargs)


def _run_on_cpu(fn, mode=_CudaFactoriesOnCpu):
    if getattr(fn, "_cpu_compat", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mode():
            return fn(*args, **kwargs)

    wrapper._cpu_compat = True
    return wrapper


class _TorchWithCpuFactories:
    """Stands in for `torch` inside one upstream module; only zeros/ones/empty/tensor differ.
    A module-level proxy costs nothing per op, unlike running a whole schedule under a
    TorchFunctionMode (+15-20% step time, measured)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _factory(name):  # noqa: N805 - builds methods at class creation
        def make(self, *args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return getattr(self._real, name)(*args, **kwargs)

        return make

    zeros = _factory("zeros")
    ones = _factory("ones")
    empty = _factory("empty")
    tensor = _factory("tensor")
    del _factory


def _current_device():
    # Every upstream use is `device=torch.cuda.current_device()`, so a cpu device is safe.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _synchronize():
    torch.cuda.synchronize = lambda device=None: None


def _rng():
    from megatron.core.tensor_parallel import random as rng

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    rng._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    rng.CudaRNGStatesTracker.add = add
    # On CPU the tracked state *is* the CPU generator, so fork() would always warn.
    logging.getLogger(rng.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


def _causal_mask():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    # On the compute device, as megatron-core's originals (device="cuda"): the strict-devices check
    # (runtime/strict_devices.py) would otherwise tag every attention output as a host tensor.
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device="cpu"), diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        allowed = torch.triu(torch.ones(sq, skv, dtype=torch.bool, device="cpu"), diagonal=skv - sq - window_size[0])
        return ~torch.tril(allowed, diagonal=skv - sq + window_size[1])

    for module in (utils, fused_softmax):
        module.get_default_causal_mask = get_default_causal_mask
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _schedules():
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _TorchWithCpuFactories):
        schedules.torch = _TorchWithCpuFactories(torch)


def _dist_ckpt():
    from megatron.core.dist_checkpointing.strategies import fully_parallel, state_dict_saver

    wrapper = fully_parallel.FullyParallelLoadStrategyWrapper
    wrapper.load = _run_on_cpu(wrapper.load)
    state_dict_saver.verify_global_md_reuse = _run_on_cpu(state_dict_saver.verify_global_md_reuse)


def _tied_embeddings():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _run_on_cpu(LanguageModule.setup_embeddings_and_output_layer)


def _moe_dispatcher_stream():
    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    cls.cuda_dtoh_stream = object()  # non-None: __init__ skips torch.cuda.Stream()

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # Nothing to copy or wait for on CPU; only upstream's as_numpy conversion remains.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


def _uneven_gather():
    """The unequal all_gather re-expressed as all_to_all_single, which gloo takes with uneven splits."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    upstream = mappings._gather_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return upstream(input_, group, output_split_sizes, use_global_buffer)
        world, rows = group.size(), input_.shape[0]
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        send = input_.contiguous().repeat((world,) + (1,) * (input_.dim() - 1))
        dist.all_to_all_single(output, send, output_split_sizes=[int(n) for n in output_split_sizes],
                               input_split_sizes=[rows] * world, group=group)
        return output

    mappings._gather_along_first_dim = gather


def _context_parallel_rope():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    patched = _run_on_cpu(rope_utils.get_pos_emb_on_this_cp_rank)
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # imported by name
        module.get_pos_emb_on_this_cp_rank = patched


def _distributed_optimizer():
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for cls, names in ((optimizer.MixedPrecisionOptimizer, ("__init__",)),
                       (distrib_optimizer.DistributedOptimizer, ("__init__", "get_parameter_state_dp_zero")),
                       (optimizer.ChainedOptimizer, ("step",))):
        for name in names:
            setattr(cls, name, _run_on_cpu(vars(cls)[name], _CudaFactoriesAndTypeNames))
    group = param_and_grad_buffer._ParamAndGradBucketGroup
    group.start_grad_sync = _with_host_stream(group.start_grad_sync)


class _HostStream:
    """What torch.cuda.current_stream() stands for on a host: work is already in order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _with_host_stream(fn):
    """megatron-core 0.19's DDP grad sync waits on the current CUDA stream for CUDA-graph events
    (distributed/param_and_grad_buffer.py:632), which a host cannot give: for the call only, it is _HostStream."""
    if getattr(fn, "_cpu_compat", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        real = torch.cuda.current_stream
        torch.cuda.current_stream = lambda device=None: _HostStream()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.current_stream = real

    wrapper._cpu_compat = True
    return wrapper


def stand_in_gated_delta_rule() -> None:
    """See UPSTREAM_SPOTS["gated_delta_rule"]: the torch gated delta rule where `fla` is missing; with `fla`
    installed, nothing changes. Idempotent."""
    import importlib

    from toolkit.blocks.kernels import gated_delta_rule
    from toolkit.runtime import megatron_versions

    homes = [importlib.import_module(name) for name in megatron_versions.gated_delta_net_modules()]
    if homes[0].HAVE_FLA:
        return
    for module in homes:  # each name where the release reads it (imported by name into several modules)
        for name in ("l2norm", "chunk_gated_delta_rule", "causal_conv1d"):
            # 0.16.1 leaves l2norm undefined without fla (gated_delta_net.py:39-47), yet calls it
            if hasattr(module, name) or (module is homes[0] and name != "causal_conv1d"):
                setattr(module, name, getattr(gated_delta_rule, name))
        if hasattr(module, "HAVE_FLA"):
            module.HAVE_FLA = True  # the guard in GatedDeltaNet.__init__ asks only whether the names are there
    homes[0].TOOLKIT_GATED_DELTA_RULE = True


def stand_in_mamba_ssm() -> None:
    """See MODEL_BUILD_SPOTS (mixer_mamba): the torch Mamba-2 scan and gated RMSNorm where `mamba_ssm` is
    missing; with it installed, nothing changes. Called where a Mamba layer is built, not at start-up: the
    module imports megatron-core's inference kernels (and, on 0.16.1, triton). Idempotent."""
    from toolkit.blocks import norms
    from toolkit.blocks.kernels import mamba2_ssd
    from toolkit.runtime import megatron_versions

    mamba_mixer = megatron_versions.mamba_mixer_module()

    if mamba_mixer.HAVE_MAMBA_SSM:
        return
    for name in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "RMSNormGated"):
        setattr(mamba_mixer, name, getattr(mamba2_ssd, name))
    mamba_mixer.ExtendedRMSNorm = norms.ExtendedRMSNorm
    mamba_mixer.HAVE_MAMBA_SSM = True  # the guard in MambaMixer.__init__ asks only whether the names are there
    mamba_mixer.TOOLKIT_MAMBA_SSD = True


def define_te_general_gemm() -> None:
    """See TE_GEMM_SPOT: without TE the router's gating linear falls back to torch once the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_PATCHES = {
    "current_device": _current_device,
    "synchronize": _synchronize,
    "rng": _rng,
    "causal_mask": _causal_mask,
    "schedules": _schedules,
    "dist_ckpt": _dist_ckpt,
    "tied_embeddings": _tied_embeddings,
    "moe_dispatcher_stream": _moe_dispatcher_stream,
    "uneven_gather": _uneven_gather,
    "distributed_optimizer": _distributed_optimizer,
    "context_parallel_rope": _context_parallel_rope,
    "gated_delta_rule": stand_in_gated_delta_rule,
}


def mask_expert_bias_counts_per_token() -> None:
    """See EXPERT_BIAS_MASK_SPOT: the counts as upstream's fix makes them, the flattened padding mask
    broadcast over the experts (padding tokens count for no expert). Idempotent, and right with a
    megatron-core that has the fix too, since the mask it passes is the same [tokens] one."""
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


def eager_fusions() -> None:
    """See EAGER_FUSIONS_SPOT: torch.compile'd functions run as written (Dynamo's own switch, read at each call)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def apply_upstream_fixes() -> None:
    """The fixes for megatron-core bugs that are not about the CPU: applied on every device."""
    define_te_general_gemm()
    mask_expert_bias_counts_per_token()
    stand_in_gated_delta_rule()  # a GPU without `fla` lacks it as a CPU does


def apply(force: bool = False) -> list[str]:
    """Apply every patch once, only on a machine without CUDA. Returns the names applied."""
    apply_upstream_fixes()
    if APPLIED or (torch.cuda.is_available() and not force):
        return APPLIED
    for name, patch in _PATCHES.items():
        patch()
        APPLIED.append(name)
    eager_fusions()
    APPLIED.append("eager_fusions")
    _log.debug("megatron-core CPU patches applied: %s", APPLIED)
    return APPLIED


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed, CPU accelerator: every deepspeed.comm TorchBackend() JIT-builds the
    `deepspeed_shm_comm` op (deepspeed/comm/torch.py:207, 20-35 s of gcc), used only by
    inference_all_reduce. Training all-reduces go through gloo, so skip the build."""
    # `import deepspeed.comm.torch` would bind the torch package (deepspeed.comm has a `torch` attribute).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def allow_deepspeed_fp16() -> None:
    """DeepSpeed, CPU accelerator: `is_fp16_supported()` (deepspeed/accelerator/cpu_accelerator.py:228-233)
    is true only where oneDNN has native fp16 kernels (AVX512-FP16 / AMX-FP16), and engine.py:2003-2004
    then refuses fp16 ("Type fp16 is not supported on your device"). torch's generic CPU kernels run
    every fp16 op a training step needs (torch 2.13: matmul, linear and SDPA forward and backward,
    softmax, RMSNorm, cross-entropy), so say so, on CPU only; with CUDA the accelerator's own answer stands."""
    if torch.cuda.is_available():
        return
    import deepspeed

    deepspeed.get_accelerator().is_fp16_supported = lambda: True
