"""LoRA fine-tuning matches HF PEFT itself, step for step, at every layout; the adapter exports as
an HF PEFT directory that PeftModel.from_pretrained loads.

The reference is HF transformers + peft.get_peft_model with the same LoRA config and initial
weights (an adapter PEFT saved, with non-zero B), trained single-process with torch.optim.AdamW
on the same global batches (tests/finetune_harness.py). Each layout is one torchrun launch.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.finetune_harness import hf_reference, launch, read_metrics, recipe, write_peft_adapter, write_uneven_data
from toolkit.convert import hf_to_megatron

STEPS = 10
LOSS_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-4  # relative
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    data = write_uneven_data(root / "data.jsonl", 300)
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    megatron = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    adapters = {
        "all": write_peft_adapter(hf, root / "adapter-all", ALL_TARGETS, r=4, alpha=8.0),
        "qv-rslora": write_peft_adapter(hf, root / "adapter-qv", ["q_proj", "v_proj"], r=4, alpha=8.0, use_rslora=True),
    }
    references = {}

    def reference(name, cfg_path):
        if name not in references:
            references[name] = hf_reference(hf, data, cfg_path, STEPS, adapter=adapters[name])
        return references[name]

    return root, data, hf, megatron, adapters, reference


def lora_run(setup, tmp_path, nprocs, parallel, adapter="all", **overrides):
    _, data, _, megatron, adapters, reference = setup
    cfg = recipe(tmp_path, megatron, data, parallel=parallel, peft={"enabled": True, "init_from": str(adapters[adapter])},
                 **overrides)
    result = launch(nprocs, cfg)
    return cfg, result


def assert_matches_reference(setup, tmp_path, cfg, adapter="all"):
    metrics = read_metrics(tmp_path / "run")
    ref_losses, ref_norms = setup[5](adapter, cfg)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses, norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst < LOSS_TOLERANCE, f"max |loss - reference| = {worst:.2e}\n{losses}\n{ref_losses}"
    worst_norm = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    assert worst_norm < NORM_TOLERANCE, f"max relative grad-norm difference {worst_norm:.2e}\n{norms}\n{ref_norms}"
    return worst, worst_norm


def exported_keys_and_shapes(adapter_dir):
    from safetensors.torch import load_file

    return {k: tuple(v.shape) for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "nprocs, parallel, adapter",
    [
        (4, {"tp": 2, "pp": 1, "zero_stage": 1}, "all"),
        (4, {"tp": 1, "pp": 2, "zero_stage": 1}, "all"),
        (8, {"tp": 2, "pp": 2, "zero_stage": 1}, "all"),
        (2, {"tp": 1, "pp": 1, "zero_stage": 2}, "qv-rslora"),
        (2, {"tp": 1, "pp": 1, "zero_stage": 3}, "all"),
    ],
    ids=["TP2xDP2-zero1", "PP2xDP2-zero1", "TP2xPP2xDP2-zero1", "DP2-zero2-qv-rslora", "DP2-zero3"],
)
def test_lora_losses_and_grad_norms_match_peft_reference(setup, tmp_path, nprocs, parallel, adapter):
    cfg, _ = lora_run(setup, tmp_path, nprocs, parallel, adapter)
    assert_matches_reference(setup, tmp_path, cfg, adapter)
    exported = tmp_path / "run" / "adapter"
    config = json.loads((exported / "adapter_config.json").read_text())
    source = json.loads((setup[4][adapter] / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "use_rslora")} == {k: source[k] for k in ("r", "lora_alpha", "use_rslora")}
    assert sorted(config["target_modules"]) == sorted(source["target_modules"]) and config["base_model_name_or_path"]
    assert exported_keys_and_shapes(exported) == exported_keys_and_shapes(setup[4][adapter])
    assert not (tmp_path / "run" / "hf").exists()
