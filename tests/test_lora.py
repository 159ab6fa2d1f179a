"""LoRA fine-tuning matches HF PEFT itself, step for step, at every layout; the adapter exports as
an HF PEFT directory that PeftModel.from_pretrained loads.

The reference is HF transformers + peft.get_peft_model with the same LoRA config and initial
weights (an adapter PEFT saved, with non-zero B), trained single-process with torch.optim.AdamW
on the same global batches (tests/finetune_harness.py). Each layout is one torchrun launch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.finetune_harness import hf_reference, launch, read_metrics, recipe, write_peft_adapter, write_uneven_data
from toolkit.convert import hf_to_megatron

STEPS = 10
LOSS_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-4  # relative
LOSS_TOLERANCE_BF16 = 2e-2  # as tests/test_finetune_parity.py
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Setup:
    data: Path
    models: dict  # name -> (HF directory, converted megatron checkpoint)
    adapters: dict  # name -> (model name, HF PEFT adapter directory saved by peft)
    references: dict = field(default_factory=dict)

    def hf(self, adapter="all") -> Path:
        return self.models[self.adapters[adapter][0]][0]

    def megatron(self, adapter="all") -> Path:
        return self.models[self.adapters[adapter][0]][1]

    def adapter(self, name="all") -> Path:
        return self.adapters[name][1]

    def reference(self, adapter, cfg_path):
        if adapter not in self.references:
            self.references[adapter] = hf_reference(self.hf(adapter), self.data, cfg_path, STEPS, adapter=self.adapter(adapter))
        return self.references[adapter]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    models = {}
    for name, variant in (("llama", "llama-odd-vocab"), ("phi3", "phi3")):
        hf = make_tiny_model(variant, root / f"hf-{name}", dtype="float32", num_hidden_layers=4, vocab_size=250)
        models[name] = (hf, hf_to_megatron(hf, root / f"mc-{name}", fmt="torch_dist", progress=False))
    llama, phi3 = models["llama"][0], models["phi3"][0]
    adapters = {
        "all": ("llama", write_peft_adapter(llama, root / "adapter-all", ALL_TARGETS, r=4, alpha=8.0)),
        "qv-rslora": ("llama", write_peft_adapter(llama, root / "adapter-qv", ["q_proj", "v_proj"], r=4, alpha=8.0,
                                                  use_rslora=True)),
        # Phi-3's HF modules are fused (qkv_proj, gate_up_proj): B follows the HF_QKV / HF_GATE_UP splits
        "phi3-all": ("phi3", write_peft_adapter(phi3, root / "adapter-phi3", "all-linear", r=4, alpha=8.0)),
    }
    return Setup(write_uneven_data(root / "data.jsonl", 300), models, adapters)


def lora_run(setup, tmp_path, nprocs, parallel, adapter="all", **overrides):
    cfg = recipe(tmp_path, setup.megatron(adapter), setup.data, parallel=parallel,
                 peft={"enabled": True, "init_from": str(setup.adapter(adapter))}, **overrides)
    return cfg, launch(nprocs, cfg)


def assert_matches_reference(setup, tmp_path, cfg, adapter="all", loss_tolerance=LOSS_TOLERANCE):
    metrics = read_metrics(tmp_path / "run")
    ref_losses, ref_norms = setup.reference(adapter, cfg)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses, norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst < loss_tolerance, f"max |loss - reference| = {worst:.2e}\n{losses}\n{ref_losses}"
    worst_norm = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    if loss_tolerance == LOSS_TOLERANCE:
        assert worst_norm < NORM_TOLERANCE, f"max relative grad-norm difference {worst_norm:.2e}\n{norms}\n{ref_norms}"
    print(f"max |loss - peft reference| {worst:.2e}, max relative grad-norm difference {worst_norm:.2e}")


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
        (4, {"tp": 2, "pp": 1, "zero_stage": 1}, "phi3-all"),
    ],
    ids=["TP2xDP2-zero1", "PP2xDP2-zero1", "TP2xPP2xDP2-zero1", "DP2-zero2-qv-rslora", "DP2-zero3", "phi3-TP2xDP2-zero1"],
)
def test_lora_losses_and_grad_norms_match_peft_reference(setup, tmp_path, nprocs, parallel, adapter):
    cfg, _ = lora_run(setup, tmp_path, nprocs, parallel, adapter)
    assert_matches_reference(setup, tmp_path, cfg, adapter)
    exported = tmp_path / "run" / "adapter"
    config = json.loads((exported / "adapter_config.json").read_text())
    source = json.loads((setup.adapter(adapter) / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "use_rslora")} == {k: source[k] for k in ("r", "lora_alpha", "use_rslora")}
    # PEFT's all-linear saves full module paths; PEFT matches either by the module name
    assert sorted(config["target_modules"]) == sorted({m.rsplit(".", 1)[-1] for m in source["target_modules"]})
    assert config["base_model_name_or_path"]
    assert exported_keys_and_shapes(exported) == exported_keys_and_shapes(setup.adapter(adapter))
    assert not (tmp_path / "run" / "hf").exists()


def peft_logits(hf_dir, adapter_dir, tokens):
    """HF PEFT's own loading path: PeftModel.from_pretrained on the HF base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)).logits


def held_out_tokens(seed=7):
    return torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(seed)).tolist()


def adapter_tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.mark.multiprocess
def test_exported_adapter_gives_peft_the_megatron_logits_and_merges_like_peft(setup, tmp_path, capsys):
    """Train at DP2, export; megatron-core at TP2 with that adapter and PeftModel.from_pretrained
    agree on a held-out batch, and gathering the adapter back from TP2 reproduces the export.
    `convert megatron-to-hf --adapter` writes the same adapter; `--merge` equals merge_and_unload()."""
    from toolkit.cli import main as cli
    from toolkit.runtime.launch import run_on_processes

    hf, megatron = setup.hf(), setup.megatron()
    lora_run(setup, tmp_path, 2, {"tp": 1, "pp": 1, "zero_stage": 1})
    step = tmp_path / "run" / "checkpoints" / "step_0000010"
    assert cli(["convert", "megatron-to-hf", "--adapter", str(step), str(tmp_path / "cli-adapter")]) == 0
    assert cli(["convert", "megatron-to-hf", "--adapter", "--merge", str(step), str(tmp_path / "merged")]) == 0
    assert_merged_equals_peft_merge(hf, tmp_path / "cli-adapter", tmp_path / "merged")
    exported, tokens = tmp_path / "run" / "adapter", held_out_tokens()
    (ours, _), _ = run_on_processes("tests.mp_workers:lora_logits", 2, str(megatron), str(exported), tokens,
                                    str(tmp_path / "again"), tp=2)
    theirs = peft_logits(hf, exported, tokens)
    worst = float((torch.tensor(ours) - theirs).abs().max())
    assert worst < 1e-4, worst
    trained, untrained = adapter_tensors(exported), adapter_tensors(setup.adapter())
    assert any(not torch.equal(trained[k], untrained[k]) for k in trained), "the adapter did not train"
    again, cli_export = adapter_tensors(tmp_path / "again"), adapter_tensors(tmp_path / "cli-adapter")
    assert all(torch.equal(again[k], trained[k]) and torch.equal(cli_export[k], trained[k]) for k in trained)
    print(f"max |logit difference| vs PeftModel.from_pretrained: {worst:.2e}")


@pytest.mark.multiprocess
def test_import_then_export_at_tp2_reproduces_the_adapter_bit_exactly(setup, tmp_path):
    from toolkit.runtime.launch import run_on_processes

    run_on_processes("tests.mp_workers:lora_logits", 2, str(setup.megatron()), str(setup.adapter()), held_out_tokens(),
                     str(tmp_path / "out"), tp=2)
    source, out = adapter_tensors(setup.adapter()), adapter_tensors(tmp_path / "out")
    assert sorted(source) == sorted(out)
    assert all(torch.equal(source[k], out[k]) for k in source)


@pytest.mark.multiprocess
def test_swapped_query_group_rows_of_b_break_parity_with_peft(setup):
    """Guard: the logits comparison does see the per-query-group interleave of B in linear_qkv."""
    from toolkit.runtime.launch import run_on_processes

    tokens = held_out_tokens()
    ((correct, swapped),) = run_on_processes("tests.mp_workers:lora_logits", 1, str(setup.megatron()),
                                             str(setup.adapter()), tokens, swap_query_groups=True)
    theirs = peft_logits(setup.hf(), setup.adapter(), tokens)
    assert float((torch.tensor(correct) - theirs).abs().max()) < 1e-4
    assert float((torch.tensor(swapped) - theirs).abs().max()) > 1e-3


def assert_merged_equals_peft_merge(hf, adapter_dir, merged_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), adapter_dir)
    expected = peft.merge_and_unload().state_dict()
    ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(expected)
    worst = max(float((ours[k] - expected[k]).abs().max()) for k in ours)
    assert worst < 1e-6, worst
    changed = [k for k in ours if "q_proj" in k and not torch.equal(ours[k], AutoModelForCausalLM.from_pretrained(
        hf, dtype=torch.float32).state_dict()[k])]
    assert changed, "the merge changed nothing"
    print(f"max |merged - merge_and_unload()|: {worst:.2e}")


@pytest.mark.multiprocess
def test_lora_resume_is_bit_exact_and_checkpoints_hold_only_the_adapter(setup, tmp_path):
    """A run resumed from its step-5 checkpoint repeats the uninterrupted losses and gradient
    norms exactly; the checkpoint holds the adapter (and its optimizer state), not the base."""
    import shutil

    parallel = {"tp": 2, "pp": 1, "zero_stage": 1}
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight_dir.mkdir()
    cfg, _ = lora_run(setup, straight_dir, 4, parallel, save_every=5)
    straight = read_metrics(straight_dir / "run")

    step5 = straight_dir / "run" / "checkpoints" / "step_0000005"
    assert (step5 / "adapter" / "toolkit_base.json").is_file() and not (step5 / "model").exists()
    states_files = list((step5 / "ds").glob("*model_states.pt"))
    assert states_files
    for states in states_files:
        module = torch.load(states, map_location="cpu", weights_only=False)["module"]
        tensors = [k for k, v in module.items() if isinstance(v, torch.Tensor)]  # _extra_state entries are None
        assert tensors and all(".lora_" in k for k in tensors), sorted(tensors)[:3]

    # The same run stopped after its step-5 checkpoint: step 10 and its metrics never written.
    shutil.copytree(straight_dir, resumed_dir)
    checkpoints = resumed_dir / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step_0000010")
    (checkpoints / "latest").write_text("step_0000005")
    metrics = resumed_dir / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:5]))
    resumed_cfg = recipe(resumed_dir, setup.megatron(), setup.data, parallel=parallel, save_every=5,
                         peft={"enabled": True, "init_from": str(setup.adapter())})
    launch(4, resumed_cfg, "resume=auto")
    resumed = read_metrics(resumed_dir / "run")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight], "fp32 resume must be exact"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight]


@pytest.mark.multiprocess
def test_lora_bf16_stays_close_to_fp32_peft_reference(setup, tmp_path):
    """bf16 rounds the frozen base and the activations: a loss within 2% of the fp32 reference."""
    cfg, _ = lora_run(setup, tmp_path, 2, {"tp": 1, "pp": 2, "zero_stage": 1}, precision="bf16")
    assert_matches_reference(setup, tmp_path, cfg, loss_tolerance=LOSS_TOLERANCE_BF16)


@pytest.mark.multiprocess
def test_peft_initialisation_is_the_same_at_tp1_and_tp2(setup, tmp_path):
    """Without init_from: A Kaiming-uniform(a=sqrt(5)) as PEFT draws it (bound 1/sqrt(in)), B zero,
    seeded per tensor so that TP ranks agree on the replicated parts and every layout gets the
    same adapter."""
    import math

    from toolkit.runtime.launch import run_on_processes

    for tp in (1, 2):
        run_on_processes("tests.mp_workers:lora_logits", tp, str(setup.megatron()), str(setup.adapter()),
                         held_out_tokens(), str(tmp_path / f"tp{tp}"), tp=tp, fresh=True)
    tp1, tp2 = adapter_tensors(tmp_path / "tp1"), adapter_tensors(tmp_path / "tp2")
    assert sorted(tp1) == sorted(tp2) and all(torch.equal(tp1[k], tp2[k]) for k in tp1)
    for key, tensor in tp1.items():
        if ".lora_B." in key:
            assert not tensor.any(), key
        else:
            bound = 1 / math.sqrt(tensor.shape[1])
            assert 0.9 * bound < float(tensor.abs().max()) <= bound, key
