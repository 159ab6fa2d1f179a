"""Memory per GPU for a TP x PP x DP x ZeRO layout: model states and activations together.

    from toolkit.memory import estimate, GPU, CPU_LOCAL
    est = estimate(spec, setup, seq_len=4096, recompute="full")
"""

from __future__ import annotations

from toolkit.memory.activations import CPU_LOCAL, GPU, Kernels
from toolkit.memory.estimate import GIB, Estimate, StageMemory, estimate

__all__ = ["CPU_LOCAL", "GPU", "GIB", "Estimate", "Kernels", "StageMemory", "estimate"]
