"""Device-strict collectives: a check that lets CPU runs catch what NCCL would refuse.

Under NCCL every tensor handed to a collective must be on the rank's GPU. gloo on a CPU-only
machine accepts any tensor, so a tensor our code creates without `device=` (a host tensor on a
GPU machine) passes every CPU test and raises on the first GPU step. With
TOOLKIT_STRICT_DEVICES=1 (set by the multi-process fine-tuning tests) this module models the
host/device split on CPU:

* a tensor that *our* code (anything outside the installed libraries: toolkit/, recipes/,
  tests/) creates with a factory function without naming a device is tagged as a host tensor;
* the tag follows it through operations, and `.to(device)` / `.cuda()` clear it;
* torch.distributed's tensor collectives, called from our code, raise if given a tagged tensor
  or a tensor that is not on the rank's compute device.

Library code (megatron-core, DeepSpeed) is not checked: it picks its devices itself. Neither is
toolkit/runtime/cpu_compat.py, whose functions stand in for megatron-core's on CPU only (on a GPU
the upstream ones run), e.g. the MoE dispatcher's uneven gather.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "TOOLKIT_STRICT_DEVICES"
TAG = "_toolkit_host_tensor"
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace}
# isend/irecv stay unwrapped: torch.distributed.P2POp accepts only those very functions.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "send", "recv", "all_to_all_single")
_LIBRARY_ROOTS = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]})
_LIBRARY_STAND_INS = (str(Path(__file__).with_name("cpu_compat.py").resolve()),)


class DeviceError(RuntimeError):
    """A collective got a tensor NCCL would refuse (not on the rank's compute device)."""


@functools.lru_cache(maxsize=None)
def _is_our_file(filename: str) -> bool:
    resolved = str(Path(filename).resolve())
    return not filename.startswith("<") and not resolved.startswith(_LIBRARY_ROOTS) and resolved not in _LIBRARY_STAND_INS


def _is_our_code(frame) -> bool:
    return _is_our_file(frame.f_code.co_filename)


def _caller_is_ours(depth: int) -> bool:
    """Whether the first frame outside torch itself, `depth` frames up, is our code."""
    frame = sys._getframe(depth + 1)
    torch_root = str(Path(torch.__file__).parent)
    while frame is not None and frame.f_code.co_filename.startswith(torch_root):
        frame = frame.f_back
    return frame is not None and _is_our_code(frame)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _names_a_device(args, kwargs) -> bool:
    candidates = [*args[1:], kwargs.get("device")]
    return any(isinstance(c, (torch.device, str, int)) and not isinstance(c, bool) for c in candidates if c is not None)


class HostTensorTracker(TorchFunctionMode):
    """Tags host tensors made by our code and follows the tag through operations."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES:
            host = "device" not in kwargs and _caller_is_ours(1)
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and _names_a_device(args, kwargs):
            host = False
            if result is args[0] and getattr(result, TAG, False):
                result = result.clone()  # on a GPU the move makes a new tensor; the host one stays tagged
        else:
            host = any(getattr(t, TAG, False) for t in _tensors([*args, *kwargs.values()]))
        if host:
            for out in _tensors([result]):
                setattr(out, TAG, True)
        return result


def _checked(name: str, collective, device: torch.device):
    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        if _is_our_code(sys._getframe(1)):
            for tensor in _tensors([*args, *kwargs.values()]):
                if getattr(tensor, TAG, False) or tensor.device.type != device.type:
                    where = "a host tensor (created without device=)" if getattr(tensor, TAG, False) else str(tensor.device)
                    raise DeviceError(f"dist.{name} was given {where}; this rank computes on {device}, and NCCL "
                                      "accepts only tensors on the rank's GPU")
        return collective(*args, **kwargs)

    return wrapper


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def enable(device: torch.device) -> None:
    """Install the tracker and the collective checks for the rest of this process."""
    if getattr(dist, "_toolkit_strict_devices", False):
        return
    HostTensorTracker().__enter__()
    for name in COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name), device))
    dist._toolkit_strict_devices = True
