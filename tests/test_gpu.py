"""The single-GPU checks of the one-command GPU suite (benchmarks/gpu_suite.sh): a fine-tune of
the real recipe on one GPU (NCCL process group, the Transformer Engine layer spec where TE is
installed, bf16) against the HF reference run on the same GPU. Skipped where there is no CUDA;
this project's CI machine has none, so its CPU tests carry the device-strict collective check
(tests/test_strict_devices.py) instead."""

from __future__ import annotations

import pytest
import torch

from tests.finetune_harness import (GRAD_NORM_TOLERANCE_BF16, LOSS_TOLERANCE_BF16, differences, hf_reference, launch,
                                    read_metrics, recipe, write_uneven_data)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")]

STEPS = 10  # bf16 weights and activations against an fp32 reference: the bars of the CPU bf16 tests


def test_one_gpu_finetune_matches_the_hf_reference_on_the_gpu(tmp_path):
    from toolkit.convert import hf_to_megatron
    from toolkit.model import running_layer_spec
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama-odd-vocab", tmp_path / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    data = write_uneven_data(tmp_path / "data.jsonl", 300)
    cfg = recipe(tmp_path, mc, data, precision="bf16", parallel={"tp": 1, "pp": 1, "zero_stage": 1})
    result = launch(1, cfg)
    loss, norm = differences(read_metrics(tmp_path / "run"), *hf_reference(hf, data, cfg, STEPS, device="cuda"))
    print(f"layer spec {running_layer_spec()}; over {STEPS} steps max |loss - HF reference on the GPU| {loss:.2e}, "
          f"grad norm relative {norm:.2e}")
    assert loss < LOSS_TOLERANCE_BF16 and norm < GRAD_NORM_TOLERANCE_BF16, (loss, norm, result.stdout[-2000:])


def test_one_gpu_lora_fine_tune_matches_peft_on_the_gpu(tmp_path):
    """LoRA on the GPU, which no GPU run had covered: the adapters are made on the host after the model
    moved to the GPU (toolkit/lora/adapter.py), and DeepSpeed's engine moves them with the module. fp32,
    every linear targeted, against HF PEFT trained on the same GPU, with the CPU tests' bars
    (tests/test_lora.py)."""
    from tests.finetune_harness import write_peft_adapter
    from tests.test_lora import ALL_TARGETS, LOSS_TOLERANCE, NORM_TOLERANCE
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama-odd-vocab", tmp_path / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    adapter = write_peft_adapter(hf, tmp_path / "adapter", ALL_TARGETS, r=4, alpha=8.0)
    data = write_uneven_data(tmp_path / "data.jsonl", 300)
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 1, "pp": 1, "zero_stage": 1},
                 peft={"enabled": True, "init_from": str(adapter)})
    launch(1, cfg)
    loss, norm = differences(read_metrics(tmp_path / "run"),
                             *hf_reference(hf, data, cfg, STEPS, device="cuda", adapter=adapter))
    print(f"LoRA on the GPU over {STEPS} steps: max |loss - PEFT| {loss:.2e}, grad norm relative {norm:.2e}")
    assert loss < LOSS_TOLERANCE and norm < NORM_TOLERANCE, (loss, norm)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


def test_sdpa_attention_matches_the_reference_on_the_gpu_with_the_flash_kernel():
    """tests/test_sdpa_attention.py's comparisons on CUDA (float64 reference and megatron-core's
    DotProductAttention, outputs and gradients), plus the bf16 causal case under the flash kernel alone."""
    from tests.test_sdpa_attention import check
    from toolkit.runtime.launch import run_on_processes

    results = run_on_processes("tests.test_sdpa_attention:compare_attention", 1)[0]
    assert "flash" in results
    check(results, "cuda")
