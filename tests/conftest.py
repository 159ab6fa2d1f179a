"""Shared fixtures: tiny real HF checkpoints, built once per test session."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Several gloo ranks share two cores; one thread each avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process a test launches (fine-tunes, verify, workers) fails on a collective given a tensor
# NCCL would refuse, although gloo accepts it here (toolkit/runtime/strict_devices.py).
os.environ.setdefault("TOOLKIT_STRICT_DEVICES", "1")

# What decides where the processes tests launch compute. A test module that changed one in
# os.environ at import would move every later launch: on the GPU machine, test_dsconfig_keys.py's
# DS_ACCELERATOR=cpu made DeepSpeed put tests/test_gpu.py's model on the CPU. Collection that
# changes them fails; a test that does (the recipe's main, run in process on a CPU machine, sets
# DS_ACCELERATOR as its own process would) gets them put back before the next test.
LAUNCH_ENV = {key: os.environ.get(key) for key in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")}


def launch_env_changes() -> dict:
    return {key: (value, os.environ.get(key)) for key, value in LAUNCH_ENV.items() if os.environ.get(key) != value}


def pytest_collection_finish(session):
    if launch_env_changes():
        raise pytest.UsageError(f"importing the test modules changed the environment launches inherit "
                                f"(before, after): {launch_env_changes()}")


@pytest.fixture(autouse=True)
def launch_env_restored():
    yield
    for key, value in LAUNCH_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

# Families and variants every conversion test covers (see toolkit/tinymodels.py).
VARIANTS = ("llama", "llama-tied", "llama-odd-vocab", "llama3-scaled", "qwen2", "mistral", "qwen3", "qwen3-tied", "phi3",
            "phi4-mini", "gemma3", "olmo2", "olmo3", "smollm3")
# Built too, for the tests that need them: a single KV head (fewer than TP = 2)
FEWER_KV_HEADS_THAN_TP2 = ("qwen3-1kv", "phi3-1kv")


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    """variant -> directory of a saved tiny model (bf16 weights, plus fp32 Llama, Qwen3, Phi-4-mini, Gemma 3, OLMo 2)."""
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("hf")
    variants = VARIANTS + FEWER_KV_HEADS_THAN_TP2
    models = {v: make_tiny_model(v, root / v, dtype="bfloat16", seed=i) for i, v in enumerate(variants)}
    for seed, variant in enumerate(("llama", "qwen3", "phi4-mini", "gemma3", "olmo2"), start=42):
        models[f"{variant}-fp32"] = make_tiny_model(variant, root / f"{variant}-fp32", dtype="float32", seed=seed)
    return models


@pytest.fixture
def hf_copy(tiny_hf, tmp_path):
    """A writable copy of a tiny model, for tests that damage it."""

    def copy(variant: str = "llama") -> Path:
        dest = tmp_path / f"copy-{variant}"
        shutil.copytree(tiny_hf[variant], dest)
        return dest

    return copy


# Mixture-of-Experts families (toolkit/tinymodels.py); separate from VARIANTS, whose layouts (TP 4,
# PP 3) these models' 6 heads and 4 layers do not all fit.
MOE_VARIANTS = ("mixtral", "qwen3-moe", "qwen2-moe", "olmoe")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> dict[str, Path]:
    """variant -> fp32 tiny MoE model (logit parity), plus `<variant>-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("moe"), MOE_VARIANTS, 100, 200)


def text_and_wrapper_models(root: Path, text: str, make_wrapper, seed: int, wrapper_key: str = "vl") -> dict[str, Path]:
    """The tiny text model `text` and its multimodal wrapper (`make_wrapper(directory, dtype, seed)`), fp32 (parity)
    and `-bf16` (round trips), each seeded on its own: seed, seed + 1 (text), seed + 2, seed + 3 (wrapper)."""
    from toolkit.tinymodels import make_tiny_model

    return {text: make_tiny_model(text, root / text, seed=seed),
            f"{text}-bf16": make_tiny_model(text, root / f"{text}-bf16", dtype="bfloat16", seed=seed + 1),
            wrapper_key: make_wrapper(root / wrapper_key, "float32", seed + 2),
            f"{wrapper_key}-bf16": make_wrapper(root / f"{wrapper_key}-bf16", "bfloat16", seed + 3)}


def fp32_and_bf16_models(root: Path, variants, fp32_seed: int, bf16_seed: int) -> dict[str, Path]:
    """variant -> fp32 tiny model (logit parity), plus `<variant>-bf16` (round trips in the HF dtype);
    the i-th variant seeded fp32_seed + i and bf16_seed + i."""
    from toolkit.tinymodels import make_tiny_model

    models = {}
    for i, v in enumerate(variants):
        models[v] = make_tiny_model(v, root / v, dtype="float32", seed=fp32_seed + i)
        models[f"{v}-bf16"] = make_tiny_model(v, root / f"{v}-bf16", dtype="bfloat16", seed=bf16_seed + i)
    return models


@pytest.fixture
def moe_copy(tiny_moe, tmp_path):
    """A writable copy of a tiny MoE model, for tests that change it."""

    def copy(variant: str) -> Path:
        dest = tmp_path / f"copy-{variant}"
        shutil.copytree(tiny_moe[variant], dest)
        return dest

    return copy


def _copied_ranges(monkeypatch, kernel_copy_from: int) -> list:
    from toolkit.convert import range_copy

    copied = []
    copy_ranges = range_copy.copy_ranges
    monkeypatch.setattr(range_copy, "MIN_RANGE_BYTES", 1)
    monkeypatch.setattr(range_copy, "MIN_KERNEL_COPY_BYTES", kernel_copy_from)
    monkeypatch.setattr("toolkit.convert.torch_stream.copy_ranges",
                        lambda ranges, *a: copied.extend(ranges) or copy_ranges(ranges, *a))
    return copied


@pytest.fixture
def copy_everything(monkeypatch):
    """Every shard a split kind describes as byte ranges is copied by the kernel (copy_file_range),
    however small its ranges; returns the byte ranges copied, to show the copy path ran."""
    return _copied_ranges(monkeypatch, kernel_copy_from=1)


@pytest.fixture
def gather_everything(monkeypatch):
    """Every shard a split kind describes as byte ranges is gathered from maps of the source files
    (pwritev), however large its ranges; returns the byte ranges copied."""
    return _copied_ranges(monkeypatch, kernel_copy_from=1 << 62)


@pytest.fixture
def small_fs(tmp_path):
    """A real size-limited file system (tmpfs), so ENOSPC comes from the kernel, not from a mock."""
    mount = tmp_path / "small"
    mount.mkdir()

    def make(size: str) -> Path:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            # CI runs as root and must run the ENOSPC test; elsewhere (no root) it is skipped with the reason.
            if os.environ.get("CI"):
                pytest.fail(f"CI must be able to mount a tmpfs for the ENOSPC test: {result.stderr.strip()}")
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
        return mount

    yield make
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)  # lazy: a rank may still hold a file open


def pytest_collection_modifyitems(config, items):
    """Test files with multi-process launches first, each file's tests kept together and in order.

    CI runs the tests on 2 pytest-xdist workers, a file at a time each (`-n 2 --dist loadfile
    --no-loadscope-reorder`, .ci/run): a file's tests share its module fixtures (often a launch
    several tests check) and the Slurm tests one local cluster, so a file stays on one worker.
    The slow files go first, so the quick ones fill the end and neither worker waits alone."""
    launching = {item.path for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: item.path not in launching)  # stable: the order within is kept
