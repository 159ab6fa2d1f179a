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

    _, _, hf, megatron, _, _ = setup
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
    trained, untrained = adapter_tensors(exported), adapter_tensors(setup[4]["all"])
    assert any(not torch.equal(trained[k], untrained[k]) for k in trained), "the adapter did not train"
    again, cli_export = adapter_tensors(tmp_path / "again"), adapter_tensors(tmp_path / "cli-adapter")
    assert all(torch.equal(again[k], trained[k]) and torch.equal(cli_export[k], trained[k]) for k in trained)
    print(f"max |logit difference| vs PeftModel.from_pretrained: {worst:.2e}")


@pytest.mark.multiprocess
def test_import_then_export_at_tp2_reproduces_the_adapter_bit_exactly(setup, tmp_path):
    from toolkit.runtime.launch import run_on_processes

    _, _, _, megatron, adapters, _ = setup
    run_on_processes("tests.mp_workers:lora_logits", 2, str(megatron), str(adapters["all"]), held_out_tokens(),
                     str(tmp_path / "out"), tp=2)
    source, out = adapter_tensors(adapters["all"]), adapter_tensors(tmp_path / "out")
    assert sorted(source) == sorted(out)
    assert all(torch.equal(source[k], out[k]) for k in source)


@pytest.mark.multiprocess
def test_swapped_query_group_rows_of_b_break_parity_with_peft(setup):
    """Guard: the logits comparison does see the per-query-group interleave of B in linear_qkv."""
    from toolkit.runtime.launch import run_on_processes

    _, _, hf, megatron, adapters, _ = setup
    tokens = held_out_tokens()
    ((correct, swapped),) = run_on_processes("tests.mp_workers:lora_logits", 1, str(megatron), str(adapters["all"]),
                                             tokens, swap_query_groups=True)
    theirs = peft_logits(hf, adapters["all"], tokens)
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
    resumed_cfg = recipe(resumed_dir, setup[3], setup[1], parallel=parallel, save_every=5,
                         peft={"enabled": True, "init_from": str(setup[4]["all"])})
    launch(4, resumed_cfg, "resume=auto")
    resumed = read_metrics(resumed_dir / "run")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight], "fp32 resume must be exact"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight]
