"""Whether the HF reference of `toolkit parity` fits in one process, priced by toolkit.memory."""

from __future__ import annotations

import os

from toolkit.errors import ParityError
from toolkit.units import size

MEMINFO = "/proc/meminfo"


def reference_bytes(spec, seq_len: int, global_batch: int, lora=None) -> int:
    """The reference's peak: fp32 weights, gradients and AdamW's two moments (toolkit.memory's
    fp32 prices at TP = PP = DP = 1), and activations of a whole global batch, whose graphs it
    keeps until the step's one backward (toolkit/parity/reference.py: document_loss)."""
    from toolkit.dsconfig import Setup
    from toolkit.memory import CPU_LOCAL, estimate

    setup = Setup(gpus=1, precision="fp32", micro_batch=global_batch, global_batch=global_batch, zero=0)
    return estimate(spec, setup, seq_len, "none", CPU_LOCAL, lora=lora).gpu_bytes


def free_bytes(device: str) -> int:
    """Memory the reference can take: the GPU's free memory, or the host's available memory."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refuse_unless_fits(needed: int, free: int, device: str, params: int, shrunk_hint: str | None = None) -> None:
    """`shrunk_hint`: the --shrink-layers that fits, if any."""
    if needed > free:
        where = "on the GPU" if device == "cuda" else "in host memory"
        raise ParityError(
            f"the HF reference does not fit in one process: about {size(needed)} for {params / 1e9:.2f}B parameters "
            f"in fp32 with AdamW (16 bytes each) and a global batch of activations, and {size(free)} is free {where}; "
            "run parity on a machine with more memory, or with a smaller global_batch / data.seq_len"
            + (f", or on a shrunk copy of the model: {shrunk_hint}" if shrunk_hint else ""))
