"""Dense peak TFLOP/s per GPU model and matmul precision, for MFU and the step-time model.

Figures are NVIDIA's datasheet numbers; those quoted "with sparsity" are halved to dense. fp32 runs
matmuls in TF32 only where torch is told to (torch.set_float32_matmul_precision("high") or
allow_tf32; off by default since torch 1.12), else on the plain FP32 units, 7-15x slower.

Sources (NVIDIA datasheets): H100 SXM / PCIe / NVL, "NVIDIA H100 Tensor Core GPU" (2023); H200 SXM /
NVL, "NVIDIA H200 Tensor Core GPU" (2024); A100 40/80 GB SXM and PCIe, "NVIDIA A100 Tensor Core
GPU" (2021); L40S (2023); L4 (2023); A10 (2021); V100 SXM2 / PCIe (2020, no bf16 tensor cores).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    bf16: float | None  # TFLOP/s, dense; None: no bf16 tensor cores
    fp16: float
    tf32: float | None
    fp32: float  # the FP32 (non-tensor) units
    fp8: float | None = None  # FP8 tensor cores (Ada, Hopper); None: none


H100_SXM = Peak(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, fp8=1978.9)
H100_PCIE = Peak(bf16=756.5, fp16=756.5, tf32=378.0, fp32=51.2, fp8=1513.0)
H100_NVL = Peak(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp8=1670.5)
A100 = Peak(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5)  # 40 and 80 GB, SXM4 and PCIe alike

# torch.cuda.get_device_name() substrings, the most specific first ("H100 NVL" before "H100", "L40S" before "L4").
GPUS: tuple[tuple[str, Peak], ...] = (
    ("H100 NVL", H100_NVL),
    ("H100 PCIe", H100_PCIE),
    ("H100", H100_SXM),  # "NVIDIA H100 80GB HBM3": SXM5
    ("GH200", H100_SXM),
    ("H200 NVL", H100_NVL),  # H200 NVL: the H100 NVL's compute, more memory
    ("H200", H100_SXM),  # H200 SXM: the H100 SXM's compute
    ("A100", A100),
    ("L40S", Peak(bf16=362.05, fp16=362.05, tf32=183.0, fp32=91.6, fp8=733.0)),
    ("L4", Peak(bf16=121.0, fp16=121.0, tf32=60.0, fp32=30.3, fp8=242.5)),
    ("A10", Peak(bf16=125.0, fp16=125.0, tf32=62.5, fp32=31.2)),
    ("V100-PCIE", Peak(bf16=None, fp16=112.0, tf32=None, fp32=14.0)),
    ("V100", Peak(bf16=None, fp16=125.0, tf32=None, fp32=15.7)),
)


def gpu_peak(name: str) -> Peak | None:
    """The datasheet figures of the GPU `torch.cuda.get_device_name()` called `name`, or None."""
    lowered = name.lower()
    return next((peak for key, peak in GPUS if key.lower() in lowered), None)


def matmul_tflops(peak: Peak, precision: str, tf32: bool) -> float | None:
    """The dense peak a training run at `precision` ("bf16", "fp16", "fp32", "fp8") can reach. fp8's is
    the FP8 tensor cores' figure: an upper bound, since only the decoder GEMMs run in FP8."""
    if precision == "fp32":
        return peak.tf32 if tf32 and peak.tf32 else peak.fp32
    return getattr(peak, precision)


def tf32_enabled() -> bool:
    """Whether torch runs fp32 matmuls in TF32 (set_float32_matmul_precision "high"/"medium")."""
    import torch

    return torch.get_float32_matmul_precision() != "highest"
