"""LoRA fine-tuning matches HF PEFT itself, step for step, at every layout; the adapter exports as
an HF PEFT directory that PeftModel.from_pretrained loads.

The reference is HF transformers + peft.get_peft_model with the same LoRA config and initial
weights (an adapter PEFT saved, with non-zero B), trained single-process with torch.optim.AdamW
on the same global batches (tests/finetune_harness.py). Each layout is one torchrun launch, made
once per module (`runs`): the TP2 x DP2 run also saves its step-5 checkpoint, which the resume
and export tests start from. Every megatron-core logits check (export, import, guard,
initialisation) is one 2-process launch (`megatron_logits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.finetune_harness import (GRAD_NORM_TOLERANCE_BF16, LOSS_TOLERANCE_BF16, ReferenceCache, copy_stopped_at_step_5,
                                    hf_reference, launch, read_metrics, recipe, write_peft_adapter, write_uneven_data)
from toolkit.convert import hf_to_megatron

STEPS = 10
LOSS_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-4  # relative
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Setup:
    data: Path
    models: dict  # name -> (HF directory, converted megatron checkpoint)
    adapters: dict  # name -> (model name, HF PEFT adapter directory saved by peft)
    references: ReferenceCache = field(default_factory=ReferenceCache)

    def hf(self, adapter="all") -> Path:
        return self.models[self.adapters[adapter][0]][0]

    def megatron(self, adapter="all") -> Path:
        return self.models[self.adapters[adapter][0]][1]

    def adapter(self, name="all") -> Path:
        return self.adapters[name][1]

    def reference(self, adapter, cfg_path):
        """HF PEFT's reference for the recipe at cfg_path, computed once per recipe (ReferenceCache)."""
        return self.references.get(cfg_path, lambda: hf_reference(self.hf(adapter), self.data, cfg_path, STEPS,
                                                                   adapter=self.adapter(adapter)), self.hf(adapter))


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


# name -> (processes, parallel, adapter, recipe overrides)
LAYOUTS = {
    # also the straight run of the resume test and the source of the export test
    "TP2xDP2-zero1": (4, {"tp": 2, "pp": 1, "zero_stage": 1}, "all", {"save_every": 5}),
    # TP and PP together without DP (DP's sums: TP2xDP2 above); PP alone: bf16-PP2 below
    "TP2xPP2-zero1": (4, {"tp": 2, "pp": 2, "zero_stage": 1}, "all", {}),
    "DP2-zero2-qv-rslora": (2, {"tp": 1, "pp": 1, "zero_stage": 2}, "qv-rslora", {}),
    "DP2-zero3": (2, {"tp": 1, "pp": 1, "zero_stage": 3}, "all", {}),
    # fused qkv_proj / gate_up_proj split over TP: DP adds nothing the Llama layouts do not show
    "phi3-TP2-zero1": (2, {"tp": 2, "pp": 1, "zero_stage": 1}, "phi3-all", {}),
    "bf16-PP2": (2, {"tp": 1, "pp": 2, "zero_stage": 1}, "all", {"precision": "bf16"}),
}
RESUMED_FROM = "TP2xDP2-zero1"


class Runs:
    """Each layout of LAYOUTS trained once, on first use: name -> (recipe path, its directory)."""

    def __init__(self, setup: Setup, root: Path):
        self.setup, self.root, self.done = setup, root, {}

    def __call__(self, name: str) -> tuple[Path, Path]:
        if name not in self.done:
            nprocs, parallel, adapter, overrides = LAYOUTS[name]
            directory = self.root / name
            directory.mkdir()
            cfg = lora_recipe(self.setup, directory, parallel, adapter, **overrides)
            launch(nprocs, cfg)
            self.done[name] = (cfg, directory)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    return Runs(setup, tmp_path_factory.mktemp("lora-runs"))


def lora_recipe(setup, directory, parallel, adapter="all", **overrides):
    return recipe(directory, setup.megatron(adapter), setup.data, parallel=parallel,
                  peft={"enabled": True, "init_from": str(setup.adapter(adapter))}, **overrides)


def assert_matches_reference(setup, directory, cfg, adapter="all", loss_tolerance=LOSS_TOLERANCE,
                             norm_tolerance=NORM_TOLERANCE):
    metrics = read_metrics(directory / "run")
    ref_losses, ref_norms = setup.reference(adapter, cfg)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses, norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst_norm = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    print(f"max |loss - peft reference| {worst:.2e}, max relative grad-norm difference {worst_norm:.2e}")
    assert worst < loss_tolerance, f"max |loss - reference| = {worst:.2e}\n{losses}\n{ref_losses}"
    assert worst_norm < norm_tolerance, f"max relative grad-norm difference {worst_norm:.2e}\n{norms}\n{ref_norms}"


def exported_keys_and_shapes(adapter_dir):
    from safetensors.torch import load_file

    return {k: tuple(v.shape) for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}


PARITY_LAYOUTS = [name for name, (_, _, _, overrides) in LAYOUTS.items() if "precision" not in overrides]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", PARITY_LAYOUTS)
def test_lora_losses_and_grad_norms_match_peft_reference(setup, runs, name):
    cfg, directory = runs(name)
    adapter = LAYOUTS[name][2]
    assert_matches_reference(setup, directory, cfg, adapter)
    exported = directory / "run" / "adapter"
    config = json.loads((exported / "adapter_config.json").read_text())
    source = json.loads((setup.adapter(adapter) / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "use_rslora")} == {k: source[k] for k in ("r", "lora_alpha", "use_rslora")}
    # PEFT's all-linear saves full module paths; PEFT matches either by the module name
    assert sorted(config["target_modules"]) == sorted({m.rsplit(".", 1)[-1] for m in source["target_modules"]})
    assert config["base_model_name_or_path"]
    assert exported_keys_and_shapes(exported) == exported_keys_and_shapes(setup.adapter(adapter))
    assert not (directory / "run" / "hf").exists()


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


@pytest.fixture(scope="module")
def megatron_logits(setup, runs, tmp_path_factory):
    """One 2-process launch for every megatron-core logits check: name -> (logits, swapped logits
    or None, the directory the case exported its adapter to)."""
    from toolkit.runtime.launch import run_on_processes

    out = tmp_path_factory.mktemp("lora-logits")
    trained = runs(RESUMED_FROM)[1] / "run" / "adapter"
    source = str(setup.adapter())
    cases = {
        "trained-tp2": dict(tp=2, adapter=str(trained)),  # gathered back: must reproduce the export
        "imported-tp2": dict(tp=2, adapter=source),
        "fresh-tp2": dict(tp=2, adapter=source, fresh=True),
        "fresh-tp1": dict(tp=1, adapter=source, fresh=True),
        "swapped-tp1": dict(tp=1, adapter=source, swap_query_groups=True),
    }
    for name, case in cases.items():
        case["export"] = str(out / name)
    results, _ = run_on_processes("tests.mp_workers:lora_logits", 2, str(setup.megatron()), held_out_tokens(),
                                  list(cases.values()))
    return {name: (*result, out / name) for name, result in zip(cases, results)}


@pytest.mark.multiprocess
def test_exported_adapter_gives_peft_the_megatron_logits_and_merges_like_peft(setup, runs, megatron_logits):
    """Train at TP2 x DP2, export; megatron-core at TP2 with that adapter and
    PeftModel.from_pretrained agree on a held-out batch, and gathering the adapter back from TP2
    reproduces the export. `convert megatron-to-hf --adapter` writes the same adapter; `--merge`
    equals merge_and_unload()."""
    from toolkit.cli import main as cli

    hf, directory = setup.hf(), runs(RESUMED_FROM)[1]
    step = directory / "run" / "checkpoints" / "step_0000010"
    out = directory / "exports"
    assert cli(["convert", "megatron-to-hf", "--adapter", str(step), str(out / "cli-adapter")]) == 0
    assert cli(["convert", "megatron-to-hf", "--adapter", "--merge", str(step), str(out / "merged")]) == 0
    assert_merged_equals_peft_merge(hf, out / "cli-adapter", out / "merged")
    exported = directory / "run" / "adapter"
    ours, _, again = megatron_logits["trained-tp2"]
    theirs = peft_logits(hf, exported, held_out_tokens())
    worst = float((torch.tensor(ours) - theirs).abs().max())
    assert worst < 1e-4, worst
    trained, untrained = adapter_tensors(exported), adapter_tensors(setup.adapter())
    assert any(not torch.equal(trained[k], untrained[k]) for k in trained), "the adapter did not train"
    again, cli_export = adapter_tensors(again), adapter_tensors(out / "cli-adapter")
    assert all(torch.equal(again[k], trained[k]) and torch.equal(cli_export[k], trained[k]) for k in trained)
    print(f"max |logit difference| vs PeftModel.from_pretrained: {worst:.2e}")


@pytest.mark.multiprocess
def test_import_then_export_at_tp2_reproduces_the_adapter_bit_exactly(setup, megatron_logits):
    source, out = adapter_tensors(setup.adapter()), adapter_tensors(megatron_logits["imported-tp2"][2])
    assert sorted(source) == sorted(out)
    assert all(torch.equal(source[k], out[k]) for k in source)


@pytest.mark.multiprocess
def test_swapped_query_group_rows_of_b_break_parity_with_peft(setup, megatron_logits):
    """Guard: the logits comparison does see the per-query-group interleave of B in linear_qkv."""
    correct, swapped, _ = megatron_logits["swapped-tp1"]
    theirs = peft_logits(setup.hf(), setup.adapter(), held_out_tokens())
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
def test_lora_resume_is_bit_exact_and_checkpoints_hold_only_the_adapter(setup, runs, tmp_path):
    """A run resumed from its step-5 checkpoint repeats the uninterrupted losses and gradient
    norms exactly; the checkpoint holds the adapter (and its optimizer state), not the base."""
    nprocs, parallel, adapter, overrides = LAYOUTS[RESUMED_FROM]
    straight_dir, resumed_dir = runs(RESUMED_FROM)[1], tmp_path / "resumed"
    straight = read_metrics(straight_dir / "run")

    step5 = straight_dir / "run" / "checkpoints" / "step_0000005"
    assert (step5 / "adapter" / "toolkit_base.json").is_file() and not (step5 / "model").exists()
    states_files = list((step5 / "ds").glob("*model_states.pt"))
    assert states_files
    for states in states_files:
        module = torch.load(states, map_location="cpu", weights_only=False)["module"]
        tensors = [k for k, v in module.items() if isinstance(v, torch.Tensor)]  # _extra_state entries are None
        assert tensors and all(".lora_" in k for k in tensors), sorted(tensors)[:3]

    copy_stopped_at_step_5(straight_dir / "run", resumed_dir)
    launch(nprocs, lora_recipe(setup, resumed_dir, parallel, adapter, **overrides), "resume=auto")
    resumed = read_metrics(resumed_dir / "run")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight], "fp32 resume must be exact"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight]
    # on another layout: refused in one line naming both ways on (the same layout, or init_from its adapter)
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.train.checkpoint import CheckpointError, check_resumable
    from toolkit.train.checkpoint_verify import intact

    base = setup.megatron(adapter)
    with pytest.raises(CheckpointError, match=r"Resume it with parallel\.tp=2 parallel\.pp=1 parallel\.zero_stage=1 on 4 "
                       r"processes, or start a new run_dir .*peft\.init_from=\S+step_0000005/adapter") as refused:
        check_resumable(intact(step5), {"tp": 1, "pp": 1, "dp": 4, "zero_stage": 1}, None, CheckpointMeta.read(base),
                        16, lora=True, base_checkpoint=base)
    assert "\n" not in str(refused.value)


@pytest.mark.multiprocess
def test_lora_bf16_stays_close_to_fp32_peft_reference(setup, runs):
    """bf16 rounds the frozen base and the activations: the bf16 bars of tests/finetune_harness.py."""
    cfg, directory = runs("bf16-PP2")
    assert_matches_reference(setup, directory, cfg, loss_tolerance=LOSS_TOLERANCE_BF16,
                             norm_tolerance=GRAD_NORM_TOLERANCE_BF16)


@pytest.mark.multiprocess
def test_peft_initialisation_is_the_same_at_tp1_and_tp2(megatron_logits):
    """Without init_from: A Kaiming-uniform(a=sqrt(5)) as PEFT draws it (bound 1/sqrt(in)), B zero,
    seeded per tensor so that TP ranks agree on the replicated parts and every layout gets the
    same adapter."""
    import math

    tp1, tp2 = adapter_tensors(megatron_logits["fresh-tp1"][2]), adapter_tensors(megatron_logits["fresh-tp2"][2])
    assert sorted(tp1) == sorted(tp2) and all(torch.equal(tp1[k], tp2[k]) for k in tp1)
    for key, tensor in tp1.items():
        if ".lora_B." in key:
            assert not tensor.any(), key
        else:
            bound = 1 / math.sqrt(tensor.shape[1])
            assert 0.9 * bound < float(tensor.abs().max()) <= bound, key
