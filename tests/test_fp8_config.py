"""precision=fp8's refusals (each one line, before any process starts) and the Transformer Engine
spec's configs, built CUDA-shaped (tests/test_cuda_shaped.py's manner).

No GPU and no Transformer Engine exist here: where the decision reads them, the test stands in for
exactly the answer a GPU gives (torch.cuda's availability, device name and capability; a TE package
of a given version, or TE taken as importable where the TE spec is under test). Downstream it is the
real code: the recipe's checks (toolkit.train.build.check_fp8), megatron-core's TransformerConfig
with its FP8 validation, DeepSpeed's config from toolkit.dsconfig.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.finetune_harness import assert_refused_in_one_line, recipe_config
from tests.test_cuda_shaped import _installed_te, cuda_present
from toolkit.errors import ConfigError
from toolkit.families import spec_from_config
from toolkit.tinymodels import make_config

H100, A100, L40S, B200 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0)), \
    ("NVIDIA L40S", (8, 9)), ("NVIDIA B200", (10, 0))


def on_gpu(monkeypatch, gpu, te: bool | None) -> None:
    """A node with `gpu` (name, capability); with `te`, megatron-core's TE extension taken as importable
    (a TE for CUDA cannot be installed here), with False TE absent, with None as installed here."""
    import toolkit.model

    cuda_present(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu[1])
    if te is None:
        return
    monkeypatch.setattr(toolkit.model, "te_status", lambda: (True, "transformer_engine 2.14.0") if te else
                        (False, "transformer_engine does not import (ModuleNotFoundError: No module named "
                                "'transformer_engine')"))


def check(tmp_path, overrides):
    from toolkit.train import build

    cfg = recipe_config(tmp_path, ["precision=fp8", *overrides])
    _, spec = spec_from_config(make_config("llama").to_dict())
    build.check_fp8(cfg, spec)
    return cfg, spec


def refused(tmp_path, overrides, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        check(tmp_path, overrides)
    assert "\n" not in str(e.value), e.value


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp16", "fp8.recipe=rowwise"], "FP8 with fp16 is not supported"),
    (["precision=[fp16, fp8]"], "FP8 with fp16 is not supported"),
    (["precision=bf16", "fp8.first_last_bf16=true"], r"fp8.first_last_bf16 given with precision=bf16: set precision=fp8"),
    (["precision=fp8", "fp8.recipe=delayed", "fp8.first_last_bf16=true"], "megatron-core refuses it"),
    (["precision=fp8", "fp8.param_gather=true"], "fp8.param_gather=true is not supported yet"),
    (["precision=fp8", "peft.enabled=true"], "precision=fp8 with peft.enabled"),
    (["precision=fp8", "parallel.dp_engine=fsdp"], "precision=fp8 with parallel.dp_engine=fsdp"),
    (["precision=fp8", "fp8.recipe=nvfp4"], "must be one of tensorwise, rowwise, delayed, blockwise, mxfp8"),
])
def test_fp8_config_refusals_in_one_line(tmp_path, overrides, message):
    assert_refused_in_one_line(tmp_path, overrides, message)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8"])
def test_te_recipes_on_cpu_are_refused_and_torchaos_run(tmp_path, recipe):
    refused(tmp_path, [f"fp8.recipe={recipe}"], f"fp8.recipe={recipe} needs Transformer Engine, which runs on GPUs "
                                                "only; the local spec runs fp8.recipe=tensorwise or rowwise")
    for local in ("tensorwise", "rowwise"):
        check(tmp_path, [f"fp8.recipe={local}"])


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8"])
def test_te_recipes_on_a_gpu_without_an_importable_te_are_refused(monkeypatch, tmp_path, recipe):
    on_gpu(monkeypatch, H100, te=False)
    refused(tmp_path, [f"fp8.recipe={recipe}"], f"fp8.recipe={recipe} needs Transformer Engine, which is not usable "
                                                r"here \(transformer_engine does not import")
    check(tmp_path, ["fp8.recipe=tensorwise"])  # torchao's, on the local spec


@pytest.mark.parametrize("gpu, recipe, runs", [
    (L40S, "blockwise", "tensorwise, delayed"), (L40S, "mxfp8", "tensorwise, delayed"),
    (H100, "mxfp8", "tensorwise, delayed, blockwise")])
def test_block_scaled_recipes_on_a_gpu_that_lacks_them_are_refused(monkeypatch, tmp_path, gpu, recipe, runs):
    on_gpu(monkeypatch, gpu, te=True)
    refused(tmp_path, [f"fp8.recipe={recipe}"], rf"fp8.recipe={recipe} needs a .* GPU .*: {gpu[0]} .* runs {runs}$")


@pytest.mark.parametrize("te", [True, False])
def test_any_fp8_below_compute_capability_8_9_is_refused(monkeypatch, tmp_path, te):
    on_gpu(monkeypatch, A100, te=te)
    refused(tmp_path, ["fp8.recipe=tensorwise"], r"needs FP8 tensor cores, compute capability 8.9 or later .*: "
                                                 r"NVIDIA A100-SXM4-80GB is 8.0")


def test_fp8_with_a_te_outside_megatron_cores_range_is_refused(monkeypatch, tmp_path):
    import toolkit.model
    from toolkit.runtime import megatron_versions

    installed = megatron_versions.installed()  # before the stand-in TE, whose import fails
    _installed_te(monkeypatch, tmp_path / "site", "2.8.0")
    on_gpu(monkeypatch, H100, te=None)
    toolkit.model.te_status.cache_clear()
    monkeypatch.setattr(toolkit.model, "te_status", toolkit.model.te_status.__wrapped__)
    refused(tmp_path, ["fp8.recipe=tensorwise"], "precision=fp8 with Transformer Engine 2.8.0 with megatron-core "
                                                 + re.escape(str(installed)) + " .*install a TE in that range")


def test_rowwise_on_the_te_spec_is_refused(monkeypatch, tmp_path):
    on_gpu(monkeypatch, H100, te=True)
    refused(tmp_path, ["fp8.recipe=rowwise"], "fp8.recipe=rowwise is torchao's, for the local spec")


@pytest.mark.parametrize("gpu, recipe, extra, expected", [
    (L40S, "tensorwise", [], {"fp8": "hybrid", "first_last_layers_bf16": False}),
    (H100, "tensorwise", ["fp8.first_last_bf16=true"],
     {"fp8": "hybrid", "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}),
    (H100, "delayed", ["fp8.amax_history_len=16", "fp8.amax_compute_algo=most_recent", "fp8.margin=1"],
     {"fp8": "hybrid", "fp8_amax_history_len": 16, "fp8_amax_compute_algo": "most_recent", "fp8_margin": 1}),
    (H100, "delayed", [], {"fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max", "fp8_margin": 0}),
    (H100, "blockwise", [], {"fp8": "e4m3"}),
    (B200, "mxfp8", ["fp8.first_last_bf16=true"], {"fp8": "e4m3", "first_last_layers_bf16": True}),
])
def test_te_spec_config_of_every_recipe_builds_with_the_gpu_flags(monkeypatch, tmp_path, gpu, recipe, extra, expected):
    """Each recipe's TransformerConfig on the TE spec, as the recipe builds it (megatron-core validates its FP8
    fields in __post_init__), with the flags CUDA switches on; the weights stay bf16 and FP8 weights off."""
    from toolkit.layouts import Layout
    from toolkit.train import build

    on_gpu(monkeypatch, gpu, te=True)
    cfg, spec = check(tmp_path, [f"fp8.recipe={recipe}", "parallel.pp=2", *extra])
    config, _ = build.model_config(spec, cfg, Layout(1, 2), "te")
    assert config.fp8_recipe == recipe and config.params_dtype == torch.bfloat16 and config.bf16
    assert not config.fp8_param and not config.use_cpu_initialization and config.bias_dropout_fusion
    assert {k: getattr(config, k) for k in expected} == expected


def test_te_spec_config_of_a_moe_model_pads_the_experts_tokens_and_refuses_allgather(monkeypatch, tmp_path):
    """A Mixture-of-Experts model on the TE spec in FP8: each expert's tokens padded to FP8's GEMM multiple
    (megatron-core's moe_router_padding_for_quantization, alltoall only). megatron-core checks TE's version
    for MoE FP8 in __post_init__: TE's version is given as a TE in megatron-core's range reads (none can be
    installed here)."""
    from megatron.core import utils
    from packaging.version import Version

    from toolkit.layouts import Layout
    from toolkit.train import build

    on_gpu(monkeypatch, H100, te=True)
    monkeypatch.setattr(utils, "get_te_version", lambda: Version("2.14.0"))
    cfg = recipe_config(tmp_path, ["precision=fp8"])
    _, spec = spec_from_config(make_config("qwen3-moe").to_dict())
    build.check_fp8(cfg, spec)
    config, _ = build.model_config(spec, cfg, Layout(1, 1), "te")
    assert config.fp8 == "hybrid" and config.moe_router_padding_for_quantization and config.moe_grouped_gemm
    cfg = recipe_config(tmp_path, ["precision=fp8", "moe.dispatcher=allgather"])
    with pytest.raises(ConfigError, match="moe.dispatcher=allgather on the Transformer Engine spec") as e:
        build.check_fp8(cfg, spec)
    assert "\n" not in str(e.value)


def test_megatron_core_without_te_runs_no_fp8_hence_the_local_path(tmp_path):
    """Why the local spec does its own FP8: megatron-core's FP8 recipe and context without TE are None
    and a null context, for a config that validates (fp8_utils.py)."""
    import contextlib

    from megatron.core import fp8_utils

    from toolkit.fp8.recipes import TE_FORMAT
    from toolkit.layouts import Layout
    from toolkit.model import transformer_config

    _, spec = spec_from_config(make_config("llama").to_dict())
    for recipe, fmt in TE_FORMAT.items():
        config = transformer_config(spec, Layout(1, 1), torch.bfloat16, layer_spec="local", fp8=fmt, fp8_recipe=recipe)
        assert fp8_utils.get_fp8_recipe(config) is None
        assert isinstance(fp8_utils.get_fp8_context(config, 0), contextlib.nullcontext)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_ds_config_accepts_fp8_at_every_zero_stage_as_bf16(zero):
    """DeepSpeed's side of precision=fp8 is its bf16 block (the FP8 GEMMs are the model's)."""
    from toolkit.dsconfig import Setup, build

    _, spec = spec_from_config(make_config("llama").to_dict())
    config = build(Setup(gpus=4, zero=zero, precision="fp8", micro_batch=1, global_batch=4), spec)
    assert config["bf16"]["enabled"] and "fp16" not in config
    assert config["zero_optimization"]["stage"] == zero


def test_ds_config_cli_refuses_fp8_with_fp16_in_one_line():
    from toolkit.commands.ds_config import precision_from_flags

    assert precision_from_flags(["fp8"]) == "fp8"
    with pytest.raises(ConfigError, match="FP8 with fp16 is not supported") as e:
        precision_from_flags(["fp8", "fp16"])
    assert "\n" not in str(e.value)


def test_memory_prices_fp8_as_each_spec_keeps_it():
    """Llama-3-8B at TP 2 x PP 2, 4k tokens, on the GPU profile (Transformer Engine): the linears' kept
    inputs at 1 byte instead of 2 and two FP8 copies (row- and column-wise) of every decoder linear
    weight, counted from the published config's shapes; on the local spec (torchao) bf16's figures."""
    from toolkit.dsconfig import Setup
    from toolkit.memory import GPU, estimate
    from toolkit.memory import activations as act
    from toolkit.modelspec import read
    from tests.test_plan import MODELS

    spec = read(MODELS / "llama-3-8b")
    tp, pp, seq = 2, 2, 4096

    def stage0(precision, kernels):
        return estimate(spec, Setup(gpus=8, tp=tp, pp=pp, precision=precision, micro_batch=1, global_batch=16), seq,
                        kernels=kernels).stages[0]

    bf16, fp8 = stage0("bf16", GPU), stage0("fp8", GPU)
    h, q, kv, f = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    linear_weights = spec.num_layers // pp * (h * (q + 2 * kv) + q * h + 3 * h * f) // tp
    assert fp8.temporaries - bf16.temporaries == 2 * linear_weights
    bf16_inputs = act._linear_inputs(spec, act.Shape(seq, 1, tp, 2))
    in_flight = (bf16.activations - fp8.activations) // (spec.num_layers // pp * bf16_inputs // 2)
    assert in_flight == pp and bf16.activations - fp8.activations == in_flight * spec.num_layers // pp * bf16_inputs // 2
    assert fp8.states == bf16.states  # bf16 weights, fp32 masters and Adam as with bf16
    local_bf16, local_fp8 = stage0("bf16", act.CPU_LOCAL), stage0("fp8", act.CPU_LOCAL)
    assert (local_fp8.activations, local_fp8.temporaries) == (local_bf16.activations, local_bf16.temporaries)


def test_plan_and_memory_take_fp8_and_refuse_it_with_lora(capsys):
    from tests.test_plan import MODELS
    from toolkit.cli import main

    assert main(["memory", str(MODELS / "llama-3-8b"), "--gpus", "8", "--tp", "2", "--pp", "2",
                 "--fp8", "--seq-len", "4096"]) == 0
    assert "fp8" in capsys.readouterr().out
    assert main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--precision", "fp8", "--top", "1"]) == 0
    assert main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--precision", "fp8", "--lora-r", "16"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: precision=fp8 with LoRA is not supported yet; use bf16", err


def test_the_fp8_forward_refuses_a_linear_argument_it_would_ignore():
    """megatron-core 0.19.2's linears pass gtp_remat_size (1 unless a gtp_remat group shards the weight);
    the FP8 forward takes 1 and refuses another value, or an argument no supported release passes."""
    from toolkit.runtime import megatron_versions

    megatron_versions.check_linear_forward_arguments({"gtp_remat_size": 1})
    for later, message in (({"gtp_remat_size": 2}, "takes gtp_remat_size=1 only"),
                           ({"fp8_output": True}, "passes fp8_output=True to a linear's _forward_impl")):
        with pytest.raises(ConfigError, match=message) as e:
            megatron_versions.check_linear_forward_arguments(later)
        assert "\n" not in str(e.value)


def test_fp8_runs_mfu_against_the_bf16_peak(monkeypatch):
    """An FP8 run's MFU compares with a bf16 run's: both against the bf16 dense peak (H100 SXM 989.4)."""
    from toolkit.peak_flops import H100_SXM, matmul_tflops
    from toolkit.train.metrics import peak_tflops

    on_gpu(monkeypatch, H100, te=True)
    assert peak_tflops(None, "fp8") == peak_tflops(None, "bf16") == (989.4, "NVIDIA H100 80GB HBM3, bf16 dense")
    assert matmul_tflops(H100_SXM, "fp8", tf32=False) == 1978.9  # the datasheet's FP8 figure, dense
