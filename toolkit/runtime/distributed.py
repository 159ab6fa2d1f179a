"""Initialise torch.distributed and megatron-core's parallel state for a TP x PP x DP layout.

NCCL and one GPU per local rank when CUDA is present; gloo on CPU, with the megatron-core CPU
compatibility layer applied. Nothing else differs between the two.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.errors import DistributedError
from toolkit.runtime import cpu_compat, strict_devices

# A rank that dies must not leave the others waiting forever in a collective.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=int(os.environ.get("TOOLKIT_DIST_TIMEOUT_MIN", "10")))


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    cp: int = 1  # context-parallel size: the CP ranks of a DP rank read the same rows, each its chunks
    cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def choose_deepspeed_accelerator() -> None:
    """Without CUDA, name DeepSpeed's CPU accelerator before it is imported: it would guess the
    same, with a WARNING on every rank (the README's `DS_ACCELERATOR=cpu` is then optional)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextlib.contextmanager
def deepspeed_cpu_accelerator():
    """DeepSpeed's CPU accelerator for what runs in this block (DeepSpeed picks its accelerator once, at
    the first get_accelerator(), from DS_ACCELERATOR), with the environment put back after it: processes
    launched later inherit no DS_ACCELERATOR=cpu, which on a GPU node moves their models off the GPU."""
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)


def check_local_gpus(local_world_size: int, device_count: int) -> None:
    """One GPU per local rank (LOCAL_RANK picks it): refuse more processes on a node than GPUs, in one
    line on every rank, before rank N's torch.cuda.set_device fails with a CUDA error."""
    if local_world_size > device_count:
        raise DistributedError(
            f"{local_world_size} processes on this node, {device_count} GPU(s): start at most {device_count} per node "
            f"(torchrun --nproc_per_node={device_count}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on CPU")


def check_deepspeed_accelerator(device_count: int) -> None:
    """On a node with GPUs, DS_ACCELERATOR must be unset or `cuda`. DeepSpeed moves the model to its
    accelerator's device (engine.py, _configure_distributed_model: self.module.to(self.device)), so
    `cpu` (the value CPU-only instructions set) puts every parameter on the host, and NCCL then
    refuses DeepSpeed's first broadcast with "No backend type associated with device type cpu"."""
    chosen = os.environ.get("DS_ACCELERATOR")
    if chosen and chosen != "cuda":
        raise DistributedError(
            f"DS_ACCELERATOR={chosen} is set, but this node has {device_count} GPU(s): DeepSpeed would move the model "
            f"off the GPU, where NCCL cannot reach it; unset DS_ACCELERATOR to train on the GPUs, or hide them "
            "(CUDA_VISIBLE_DEVICES=) to run every rank on CPU")


def check_node_gpus() -> None:
    """With CUDA, check_local_gpus for the launcher's LOCAL_WORLD_SIZE and check_deepspeed_accelerator
    (recipes/finetune.py runs it before anything else, where rank 0 alone reports it)."""
    if torch.cuda.is_available():
        check_local_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        check_deepspeed_accelerator(torch.cuda.device_count())


def init_process_group() -> torch.device:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, ...)."""
    cpu_compat.apply_upstream_fixes()  # every device: megatron-core bugs, not CPU gaps
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        check_local_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)), torch.cuda.device_count())
        check_deepspeed_accelerator(torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        cpu_compat.apply()
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend(), timeout=DEFAULT_TIMEOUT)
    if strict_devices.enabled():  # tests: fail on tensors NCCL would refuse, also on CPU
        strict_devices.enable(device)
    return device


def reinit_expert_tp(info: "ParallelInfo", etp: int, tp: int, pp: int, ep: int) -> "ParallelInfo":
    """megatron-core's groups rebuilt with expert TP `etp` where they have another one (every rank
    calls this with the same arguments: building groups is collective)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() == etp:
        return info
    ps.destroy_model_parallel()
    return init_parallel(tp, pp, ep=ep, etp=etp)


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1, vpp: int = 1, cp: int = 1,
                  etp: int | None = None) -> ParallelInfo:
    """Initialise the process group and megatron-core's TP/PP/CP/DP groups; DP = world / (TP*PP*CP).
    Expert parallelism (EP) is carved out of CP x DP, with expert TP `etp`, by default TP (megatron-core's
    default; ModelSpec.expert_tp says which a model needs).
    `vpp` > 1: that many virtual stages (model chunks) per pipeline rank. `cp` > 1: megatron-core's
    context-parallel groups (the sequence split over CP ranks, toolkit.blocks.context_parallel)."""
    device = init_process_group()
    world = dist.get_world_size()
    if world % (tp * pp * cp) or (world // (tp * pp)) % ep:  # EP is carved out of CP x DP
        raise DistributedError(f"world size {world} is not divisible by TP*PP*CP*EP = {tp}*{pp}*{cp}*{ep}")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=world,
        tp=tp,
        pp=pp,
        dp=world // (tp * pp * cp),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
        cp=cp,
        cp_rank=ps.get_context_parallel_rank(),
    )


def network_error_line(error: BaseException) -> str:
    """torch's DistNetworkError (a C++ traceback of several lines) as one line that says what to do."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    cause = next((line for line in lines if "address already in use" in line.lower() or "errno" in line.lower()),
                 lines[-1] if lines else type(error).__name__)
    return (f"the process group could not be set up at {where}: {cause} (another run on this port? wait for it "
            "to end, or give the launcher another port: deepspeed --master_port P, torchrun --master-port P)")


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
