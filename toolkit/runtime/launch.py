"""Run a function on N local processes joined in one torch.distributed group.

Used by `toolkit convert verify` and by the multi-process tests. The function is named by
"module:function" so that each child sets its environment before importing torch. If any rank
raises, the others are killed and the failing rank's traceback is raised in the parent.

Every process is local, so LOCAL_RANK = rank: with CUDA, N processes need N GPUs (one each). A
launch that needs more is refused before anything starts, unless `cpu=True` hides the GPUs from
the children (gloo on CPU, as on a machine without CUDA).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from toolkit.errors import DistributedError

DEFAULT_TIMEOUT_S = 900

# What a rank imports that costs most (about 8 s of CPU per process). Without CUDA, the ranks are
# forked from a server that imported these once (multiprocessing's forkserver preload), instead of
# each importing them again; tests/forkrun.py does the same for the recipe. Missing one costs
# time, not correctness.
HEAVY_IMPORTS = (
    "deepspeed", "deepspeed.runtime.engine", "wandb", "accelerate",
    "transformers.models.llama.configuration_llama", "transformers.modeling_utils", "transformers.tokenization_utils_fast",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "megatron.core.optimizer",
    "megatron.core.dist_checkpointing.serialization", "megatron.core.transformer.moe.moe_layer",
    "toolkit.model", "toolkit.train.build", "toolkit.train.checkpoint", "toolkit.train.parallel", "toolkit.train.step",
)


# The ports the kernel hands out to outgoing connections (gloo's between ranks, any other program's);
# a rendezvous port is chosen below them, from LISTEN_PORTS_FROM up.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 10000


def free_port() -> int:
    """A TCP port free now, for a launcher to rendezvous on. Chosen at random below the kernel's
    ephemeral range: a port from inside it (what binding port 0 gives) can be handed to another
    process's outgoing connection between this check and the launcher's bind, which then fails
    with EADDRINUSE (seen with two test files launching at once: gloo's connections take many).
    Where the range is unknown or starts low, the kernel's choice."""
    try:
        first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = LISTEN_PORTS_FROM
    candidates = range(LISTEN_PORTS_FROM, first_ephemeral)
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):  # not the seedable global
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_device(nprocs: int, cuda_available: bool, device_count: int, cpu: bool = False) -> str:
    """"cuda" or "cpu" for a launch of `nprocs` local processes; refuses one GPU short."""
    if cpu or not cuda_available:
        return "cpu"
    if nprocs > device_count:
        raise DistributedError(f"{nprocs} processes need {nprocs} GPUs (one per process), {device_count} available: "
                               "use a layout with fewer processes, or pass --cpu to run on CPU")
    return "cuda"


def process_context(cuda_available: bool):
    """spawn where CUDA is present (CUDA must not be forked); else a forkserver that has imported
    HEAVY_IMPORTS, started once per parent process and shared by all its launches."""
    if cuda_available:
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    from toolkit.runtime.distributed import deepspeed_cpu_accelerator

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(HEAVY_IMPORTS))
    with deepspeed_cpu_accelerator():  # the server imports DeepSpeed with the environment it starts with
        forkserver.ensure_running()
    return ctx


def _child(target: str, rank: int, nprocs: int, port: int, device: str, env: dict, results, args, kwargs) -> None:
    # A forked child has the environment the server started with: take the launcher's own.
    os.environ.clear()
    os.environ.update(env)
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is initialised here: the child sees no GPU
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # N ranks share few cores: one thread each avoids oversubscription.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not os.environ.get("TOOLKIT_DEBUG"):
        warnings.filterwarnings("ignore")  # megatron-core warns about missing apex/TE on every import
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        results.put((rank, True, func(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_on_processes(target: str, nprocs: int, *args, timeout: float = DEFAULT_TIMEOUT_S, cpu: bool = False,
                     **kwargs) -> list[Any]:
    """Call `target(*args, **kwargs)` on ranks 0..nprocs-1 and return their results by rank.
    With `cpu`, the processes run on CPU even where CUDA is present."""
    import torch

    device = launch_device(nprocs, torch.cuda.is_available(), torch.cuda.device_count(), cpu)
    ctx = process_context(torch.cuda.is_available())
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(target, rank, nprocs, port, device, env, results, args, kwargs), daemon=False)
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < nprocs:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise DistributedError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                if time.monotonic() > deadline:
                    raise DistributedError(f"{target} did not finish on {nprocs} processes within {timeout:.0f} s")
                continue
            if not ok:
                raise DistributedError(f"rank {rank} of {nprocs} failed in {target}:\n{value}")
            collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(collected) == nprocs else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [collected[r] for r in range(nprocs)]
