"""The code paths only CUDA takes, driven on CPU (docs/cuda_audit.md lists what was checked).

No GPU, no NCCL and no Transformer Engine exist on this machine, and a CPU build of torch cannot
initialise CUDA: where a decision depends on them, the test stands in for exactly that answer
(`torch.cuda.is_available`, the device count, a broken `transformer_engine` package) and
everything downstream is the real code: megatron-core's TransformerConfig and layer specs, its
filesystem writer, DeepSpeed's config, PEFT.
"""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from toolkit.errors import ConfigError, ConversionError, DistributedError
from toolkit.families import spec_from_config
from toolkit.layouts import Layout
from toolkit.runtime import megatron_versions
from toolkit.tinymodels import VARIANTS, make_config


def cuda_present(monkeypatch, devices: int = 1) -> None:
    """What torch answers on a machine with `devices` GPUs (a CPU build of torch cannot)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


# DeepSeek Sparse Attention's families: refused in one line before megatron-core 0.19 (megatron_versions.exact_dsa)
DSA_VARIANTS = {"deepseek-v32", "glm-moe-dsa", "glm-moe-dsa-shared"}
BUILDABLE = sorted(v for v in VARIANTS if megatron_versions.exact_dsa() or v not in DSA_VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family_builds_its_config_with_the_gpu_flags(monkeypatch, variant):
    """Whatever CUDA switches on (fused bias-activation and bias-dropout, GPU initialisation), every
    family's TransformerConfig must still build: megatron-core refuses bias_activation_fusion with
    Gemma 3's gelu_tanh. Their layer specs are built in test_cuda_only_paths_in_one_launch."""
    from toolkit.model import transformer_config

    _, spec = spec_from_config(make_config(variant).to_dict())
    cuda_present(monkeypatch)
    if variant not in BUILDABLE:
        with pytest.raises(ConversionError, match=re.escape("use megatron-core >= 0.19")):
            transformer_config(spec, Layout(1, 1), torch.bfloat16)
        return
    config = transformer_config(spec, Layout(1, 1), torch.bfloat16)
    assert not config.use_cpu_initialization and config.bias_dropout_fusion  # the GPU flags are on
    # fused where megatron-core has a kernel: SwiGLU, not gpt-oss's clamped one (mlp.py:183-212)
    assert config.bias_activation_fusion == (spec.activation == "silu" and spec.glu_clamp is None)


def test_compat_fixes_that_are_not_cpu_specific_apply_with_cuda(monkeypatch):
    """megatron-core's router reads `te_general_gemm` on every device (NameError without TE): the
    fix must be applied where CUDA is present too. NCCL cannot run here, so the process group is
    taken as already joined."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from toolkit.runtime import distributed, strict_devices

    import torch._dynamo

    cuda_present(monkeypatch)
    was_disabled, torch._dynamo.config.disable = torch._dynamo.config.disable, False  # as a fresh process has it
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(strict_devices, "enabled", lambda: False)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert distributed.init_process_group() == torch.device("cuda", 0)
    # the router's gating linear, as megatron-core's MoE router calls it (moe_utils.py:1225)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    assert torch.allclose(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)
    # the expert bias's token counts with a padding mask (router.py:542, EXPERT_BIAS_MASK_SPOT), as the
    # router calls it: 5 tokens (the last two padding), 4 experts, top-1
    from megatron.core.transformer.moe.router import TopKRouter

    router = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
    routing_map = torch.nn.functional.one_hot(torch.tensor([0, 2, 2, 1, 3]), 4).bool()
    TopKRouter._apply_expert_bias(router, routing_map, torch.tensor([False, False, False, True, True]))
    assert router.local_tokens_per_expert.tolist() == [1, 0, 2, 0]
    # the CPU patches, eager fusions among them, are not applied: on GPUs megatron-core's fused helpers compile
    compiles, torch._dynamo.config.disable = not torch._dynamo.config.disable, was_disabled
    assert compiles, "cpu_compat.eager_fusions ran with CUDA present"


def test_fused_helpers_run_eagerly_after_the_cpu_patches(monkeypatch):
    """cpu_compat.EAGER_FUSIONS_SPOT: after eager_fusions a torch.compile'd function (megatron-core's jit_fuser)
    runs as written, with no frame compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from toolkit.runtime import cpu_compat

    fused = torch.compile(lambda x: x * 2 + 1)
    was = torch._dynamo.config.disable  # a config module: monkeypatch and config.patch refuse this key
    try:
        torch._dynamo.config.disable = False
        cpu_compat.eager_fusions()
        before = counters["frames"]["total"]
        assert torch.equal(fused(torch.ones(3)), torch.full((3,), 3.0))
        assert counters["frames"]["total"] == before, "compiled on CPU"
    finally:
        torch._dynamo.config.disable = was


def test_more_local_ranks_than_gpus_is_refused_in_one_line(monkeypatch):
    """4 ranks on a 1-GPU node: LOCAL_RANK 1..3 have no GPU (torch.cuda.set_device would fail
    with a CUDA error on rank 1 and leave rank 0 waiting)."""
    from toolkit.runtime import distributed

    cuda_present(monkeypatch, devices=1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) on a 1-GPU node"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(DistributedError, match=r"4 processes on this node, 1 GPU.*nproc_per_node") as refused:
        distributed.init_process_group()
    assert "\n" not in str(refused.value)


def test_recipe_refuses_more_ranks_per_node_than_gpus_in_one_line(monkeypatch, tmp_path, capsys):
    """Before anything else (the config is not even read), rank 0 says it once."""
    import runpy

    from tests.finetune_harness import RECIPE

    recipe = runpy.run_path(str(RECIPE), run_name="recipe")
    cuda_present(monkeypatch, devices=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert recipe["main"](["--config", str(tmp_path / "never-read.yaml"), "--verbose"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 4 processes on this node, 1 GPU(s)") and err.count("\n") == 1, err


@pytest.mark.parametrize("value, refused", [("cpu", True), ("xpu", True), ("cuda", False), (None, False)])
def test_ds_accelerator_other_than_cuda_on_a_gpu_node_is_refused_in_one_line(monkeypatch, value, refused):
    """DS_ACCELERATOR=cpu (from CPU-only instructions, or leaked into the environment: the GPU run of
    tests/test_gpu.py inherited it from a test module) makes DeepSpeed move the model to the host
    on a GPU node, and NCCL then fails in DeepSpeed's _broadcast_model with "No backend type
    associated with device type cpu". The recipe and init_process_group refuse it first."""
    from toolkit.runtime import distributed

    cuda_present(monkeypatch, devices=1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    if value is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", value)
    if not refused:
        distributed.check_node_gpus()
        return
    for check in (distributed.check_node_gpus, distributed.init_process_group):
        with pytest.raises(DistributedError, match=f"DS_ACCELERATOR={value} is set.*1 GPU.*unset DS_ACCELERATOR") as e:
            check()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("devices, expected", [(0, "cpu"), (1, "cpu"), (3, "cpu"), (4, "cuda"), (8, "cuda")])
def test_quickstart_runs_its_four_ranks_on_cpu_unless_there_is_a_gpu_each(devices, expected):
    from toolkit.runtime.recipe_launch import recipe_device

    assert recipe_device(4, cuda_available=devices > 0, device_count=devices) == expected


def test_recipe_uses_an_optimizer_that_needs_no_build_on_gpus(monkeypatch, tmp_path):
    """FusedAdam is JIT-built by deepspeed.initialize: without nvcc / CUDA_HOME on the node it
    raises MissingCUDAException once the model is built. torch's AdamW needs no build, and it is
    what benchmarks/finetune_bench.py's HF + DeepSpeed baseline uses."""
    from tests.finetune_harness import recipe_config
    from toolkit.train import build

    cfg = recipe_config(tmp_path, [])
    _, spec = spec_from_config(make_config("llama").to_dict())
    cuda_present(monkeypatch, devices=8)
    config = build.ds_config(cfg, spec, 8)
    assert config["optimizer"]["params"].get("torch_adam") is True, config["optimizer"]


@pytest.mark.parametrize("error", ["ImportError", "OSError"])
def test_a_transformer_engine_that_fails_to_import_runs_the_local_spec(monkeypatch, tmp_path, error):
    """A TE wheel built for another torch is found by importlib but fails to import: the layer spec
    must be decided by importing it (through megatron-core's TE extension), and the log says why."""
    import toolkit.model

    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"raise {error}('transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))]:
        monkeypatch.delitem(sys.modules, name)
    cuda_present(monkeypatch)
    if hasattr(toolkit.model, "te_status"):
        toolkit.model.te_status.cache_clear()
        monkeypatch.setattr(toolkit.model, "te_status", toolkit.model.te_status.__wrapped__)
    assert toolkit.model.running_layer_spec() == "local"
    spec, reason = toolkit.model.layer_spec_choice()
    assert spec == "local" and "undefined symbol" in reason, reason


def _installed_te(monkeypatch, tmp_path, version: str) -> None:
    """A Transformer Engine package of `version` as pip installs it (its dist-info), whose import fails as
    a build for another CUDA would: the version is read without importing it."""
    site = tmp_path / f"te-{version}"
    (site / "transformer_engine").mkdir(parents=True)
    (site / "transformer_engine" / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open')\n")
    info = site / f"transformer_engine-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(site))
    for name in [n for n in sys.modules if n.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("where", ["below", "inside", "above"])
def test_a_transformer_engine_outside_the_megatron_core_range_runs_the_local_spec_and_says_both_versions(
        monkeypatch, tmp_path, where):
    """The layer-spec decision checks TE's version against the installed megatron-core's range
    (megatron_versions.TE_RANGES) before importing it: outside it, one line with both versions and the
    spec chosen; inside it, TE is imported (here it then fails to, as a broken build would)."""
    import toolkit.model
    from toolkit.runtime import megatron_versions

    low, high = megatron_versions.TE_RANGES[megatron_versions.series()]
    version = {"below": "2.8.0", "inside": str(low), "above": f"{high.major}.{high.minor}.0"}[where]
    _installed_te(monkeypatch, tmp_path, version)
    cuda_present(monkeypatch)
    toolkit.model.te_status.cache_clear()
    monkeypatch.setattr(toolkit.model, "te_status", toolkit.model.te_status.__wrapped__)
    spec, reason = toolkit.model.layer_spec_choice()
    assert spec == "local", reason
    if where == "inside":
        assert "does not import" in reason and "libcudart" in reason, reason
    else:
        assert f"Transformer Engine {version} with megatron-core {megatron_versions.installed()}" in reason, reason
        assert f">= {low}, < {high}" in reason and "local spec" in reason and "\n" not in reason, reason


@pytest.mark.parametrize("name, precision, tf32, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),  # SXM5
    ("NVIDIA H100 PCIe", "bf16", False, 756.5),
    ("NVIDIA H100 NVL", "bf16", False, 835.5),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9),  # torch's default: fp32 matmuls without TF32
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
    ("NVIDIA H200", "bf16", False, 989.4),
    ("NVIDIA H200 NVL", "bf16", False, 835.5),
    ("NVIDIA A100-SXM4-40GB", "bf16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "fp16", False, 312.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA L40S", "bf16", False, 362.05),
    ("NVIDIA L4", "bf16", False, 121.0),
    ("Tesla V100-SXM2-32GB", "fp16", False, 125.0),
    ("Tesla V100-SXM2-32GB", "bf16", False, 0.0),  # no bf16 tensor cores: no meaningful peak
])
def test_peak_flops_per_gpu_variant_and_precision(monkeypatch, name, precision, tf32, expected):
    from toolkit.train.metrics import peak_tflops

    cuda_present(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high" if tf32 else "highest")
    peak, source = peak_tflops(None, precision)
    assert peak == pytest.approx(expected), source


def test_step_time_model_uses_the_precisions_peak():
    """fp32 matmuls run at a fraction of the bf16 peak (TF32 off, torch's default)."""
    from toolkit.dsconfig import Setup
    from toolkit.throughput import step_time

    _, spec = spec_from_config(make_config("llama").to_dict())
    times = {p: step_time(spec, Setup(gpus=1, precision=p, micro_batch=1, global_batch=8), 64, "none", 8).compute
             for p in ("bf16", "fp32")}
    assert times["fp32"] / times["bf16"] == pytest.approx(989.4 / 66.9, rel=1e-3)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    from tests.finetune_harness import recipe, write_peft_adapter, write_uneven_data
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("cuda-shaped")
    hf = make_tiny_model("llama", root / "hf", dtype="float32", num_hidden_layers=2)
    checkpoint = hf_to_megatron(hf, root / "mc", progress=False)
    adapter = write_peft_adapter(hf, root / "adapter", ["q_proj", "v_proj", "up_proj", "down_proj"], r=4, alpha=8.0)
    cfg = recipe(root, checkpoint, write_uneven_data(root / "data.jsonl", 4), peft__enabled=True,
                 peft__init_from=str(adapter))
    return hf, adapter, cfg, root


@pytest.mark.multiprocess
def test_cuda_only_paths_in_one_launch(lora_checkpoint):
    """One 1-rank launch (megatron-core needs its process group):
    - every family's layer spec, built with the flags CUDA switches on;
    - LoRA where a GPU with TE would run the TE spec: TE fuses the input norms into linear_qkv and
      linear_fc1, where the adapter would see the un-normalised input; the LoRA model must build
      with separate norms and give PeftModel's logits;
    - train/'s checkpoint writer given tensors that are not on the CPU (as DeepSpeed leaves them
      on a GPU) must stage them to the CPU, as megatron-core's execute_sync does (preload_fn);
    - with CUDA and `mamba_ssm` installed, megatron-core's MambaMixer keeps upstream's kernels: the
      stand-in (cpu_compat.stand_in_mamba_ssm) changes nothing and the training forward calls mamba_ssm's
      fused split-conv-scan (tests/mp_workers.py _mamba_ssm_kernels_where_installed)."""
    from tests.test_lora import held_out_tokens, peft_logits
    from toolkit.runtime.launch import run_on_processes

    hf, adapter, cfg, root = lora_checkpoint
    tokens = held_out_tokens()
    [out] = run_on_processes("tests.mp_workers:cuda_shaped_checks", 1, str(cfg), tokens, str(root / "saved"),
                             BUILDABLE)
    failed = {name: result["error"] for name, result in out.items() if "error" in result}
    assert not failed, "\n".join(f"{name}: {error}" for name, error in failed.items())
    assert sorted(out["gpu_layer_specs"]) == BUILDABLE
    assert out["save_from_device"]["equal"]
    if "refused" in out["mamba_ssm_kernels"]:  # megatron-core 0.16.1 on a CPU-only torch (no triton)
        from toolkit.runtime import megatron_versions

        assert megatron_versions.series() < (0, 17), out["mamba_ssm_kernels"]
        assert "pip install triton" in out["mamba_ssm_kernels"]["refused"], out["mamba_ssm_kernels"]
    else:
        assert out["mamba_ssm_kernels"] == {"kernel_kept": True, "norm": "KernelExtendedRMSNorm", "kernel_calls": 1,
                                            "stand_in_marker": False}, out["mamba_ssm_kernels"]
    lora = out["lora_under_te"]
    assert lora["classes"] == {"input_layernorm": "RMSNorm", "linear_qkv": "ColumnParallelLinear"}, lora["classes"]
    worst = float((torch.tensor(lora["logits"]) - peft_logits(hf, adapter, tokens)).abs().max())
    assert worst < 1e-4, worst


def test_sparse_attention_runs_megatron_cores_tilelang_kernels_where_cuda_has_them(monkeypatch):
    """DeepSeek Sparse Attention (toolkit/blocks/attention_dsa.py): with CUDA and megatron-core's TileLang DSA kernels
    (as its own dependency check answers), its fused backend; without either, its torch path ('none'), which is
    what the CPU runs (tests/test_family_deepseek_v32.py). Guard: the same check on this CPU says 'none'."""
    if not megatron_versions.exact_dsa():
        pytest.skip(f"DeepSeek Sparse Attention is refused on megatron-core {megatron_versions.installed()} (< 0.19)")
    from megatron.core import utils

    from toolkit.blocks.attention_dsa import kernel_backend
    from toolkit.model import transformer_config

    assert kernel_backend() == "none"
    _, spec = spec_from_config(make_config("deepseek-v32").to_dict())
    assert transformer_config(spec, Layout(1, 1), torch.float32).dsa_kernel_backend == "none"
    cuda_present(monkeypatch)
    monkeypatch.setattr(utils, "_missing_tilelang_dsa_kernel_dependencies", lambda: ["TileLang DSA kernels"])
    assert kernel_backend() == "none"
    monkeypatch.setattr(utils, "_missing_tilelang_dsa_kernel_dependencies", lambda: [])
    assert kernel_backend() == "tilelang"
    assert transformer_config(spec, Layout(1, 1), torch.bfloat16).dsa_kernel_backend == "tilelang"
