"""A checkpoint written by megatron-core's own trainer objects (DistributedDataParallel with its
DistributedOptimizer, dist_checkpointing.save, as Megatron-LM saves torch_dist) read by our tools:
exported to HF exactly, and a fine-tune started from it with its Adam state (model.optimizer_state)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.finetune_harness import launch, recipe, write_uneven_data
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.dist_format import read_box, tensor_shapes
from toolkit.convert.megatron_checkpoint import OPTIMIZER_PREFIX, VOCAB_KEYS, resolve_iteration_dir
from toolkit.errors import ToolkitError
from toolkit.runtime import megatron_versions
from toolkit.runtime.launch import run_on_processes
from toolkit.tinymodels import make_tiny_model

VOCAB = 250  # padded to 256 rows in both checkpoints; an export drops the padding rows
MEGATRON_STEPS = 3  # Adam steps megatron-core takes before saving
COMPARE = Path(__file__).parent / "recipe_compares_megatron_optimizer.py"


def whole(directory, key: str, shape, dtype) -> torch.Tensor:
    return read_box(directory, key, (0,) * len(shape), shape, dtype)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """2 ranks (DP2) of megatron-core DDP + DistributedOptimizer, 3 Adam steps, saved with its
    optimizer state (fully_reshardable, and a dp_reshardable copy); then exported to HF and that
    export converted back, as a user starting a fine-tune from it would."""
    tmp = tmp_path_factory.mktemp("megatron-ckpt")
    hf = make_tiny_model("llama-odd-vocab", tmp / "hf", dtype="float32", num_hidden_layers=4, vocab_size=VOCAB)
    start = hf_to_megatron(hf, tmp / "start", fmt="torch_dist", progress=False)
    saved, dp_reshardable = tmp / "megatron", tmp / "megatron-dp-reshardable"
    losses = run_on_processes("tests.mp_workers:megatron_distributed_optimizer_checkpoint", 2, str(start), str(saved),
                              MEGATRON_STEPS, str(dp_reshardable))
    assert all(loss == loss for loss in losses)
    exported = megatron_to_hf(saved, tmp / "exported", hf_config=hf, progress=False)
    back = hf_to_megatron(exported, tmp / "back", fmt="torch_dist", progress=False)
    return {"hf": hf, "start": start, "saved": saved, "dp_reshardable": dp_reshardable, "back": back,
            "data": write_uneven_data(tmp / "data.jsonl", 40)}


@pytest.mark.multiprocess
def test_megatron_core_distributed_optimizer_checkpoint_exports_its_exact_weights(megatron):
    """`megatron-to-hf` exports it; converted back, every model tensor is the one megatron-core
    saved, bit for bit (and training moved it away from the starting weights)."""
    saved = megatron["saved"]
    stored = tensor_shapes(saved)
    assert {k for k in stored if k.startswith(OPTIMIZER_PREFIX + "state.exp_avg.")}, "the optimizer state is there"
    back, before = resolve_iteration_dir(megatron["back"]), resolve_iteration_dir(megatron["start"])
    model_keys = tensor_shapes(back)
    assert set(model_keys) == {k for k in stored if not k.startswith(OPTIMIZER_PREFIX)}
    moved = 0
    for key, (shape, dtype) in model_keys.items():
        theirs = whole(saved, key, shape, dtype)
        ours = whole(back, key, shape, dtype)
        rows = slice(0, VOCAB) if key in VOCAB_KEYS else slice(None)  # padding rows are not exported
        assert torch.equal(ours[rows], theirs[rows]), key
        moved += not torch.equal(theirs, whole(before, key, shape, dtype))
    assert moved == len(model_keys), "every tensor trained"


def compare_at_start(megatron, tmp_path, *overrides: str) -> list[dict]:
    """The recipe at TP2 (Megatron's run was DP2) from the converted export, stopped before its
    first step: what differs from megatron-core's saved optimizer state, per rank."""
    cfg = recipe(tmp_path, megatron["back"], megatron["data"], parallel={"tp": 2}, steps=1)
    report = tmp_path / "report"
    report.mkdir()
    launch(2, cfg, *overrides, script=COMPARE,
           env={"MEGATRON_CHECKPOINT": str(megatron["saved"]), "CHECK_REPORT": str(report)})
    return [json.loads((report / f"rank_{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.multiprocess
def test_finetune_starts_from_megatron_fp32_masters_and_adam_moments(megatron, tmp_path):
    """model.optimizer_state: at another layout than Megatron's (TP2 instead of DP2), every fp32
    master weight, exp_avg and exp_avg_sq in our DeepSpeed engine is megatron-core's saved one,
    bit for bit, and Adam goes on from Megatron's step (the default, optimizer_step=keep)."""
    for rank in compare_at_start(megatron, tmp_path, f"model.optimizer_state={megatron['saved']}"):
        assert len(rank["parameters"]) == 27  # 4 layers x 6, embedding, final norm, output layer
        assert rank["differ"] == {"param": [], "exp_avg": [], "exp_avg_sq": []}
        assert rank["adam_steps"] == [MEGATRON_STEPS]


@pytest.mark.multiprocess
def test_guard_without_optimizer_state_the_moments_differ(megatron, tmp_path):
    """Guard: the same comparison with the option off fails on every moment (Adam's state starts at
    zero). The masters agree but for the output layer's padding rows, which Megatron trained and an
    export drops (the conversion pads with zeros; the loss masks them)."""
    for rank in compare_at_start(megatron, tmp_path):
        assert set(rank["differ"]["param"]) <= {"output_layer.weight"}
        for moment in ("exp_avg", "exp_avg_sq"):
            assert sorted(rank["differ"][moment]) == rank["parameters"], moment
        assert rank["adam_steps"] in ([], [0])


def prepare(megatron, tmp_path, *overrides: str):
    from tests.test_lora_inputs import recipe_module

    cfg = recipe(tmp_path, megatron["back"], megatron["data"])
    return recipe_module().prepare(str(cfg), list(overrides))


def test_optimizer_step_reset_starts_adam_at_step_zero(megatron, tmp_path):
    run = prepare(megatron, tmp_path, f"model.optimizer_state={megatron['saved']}", "model.optimizer_step=reset")
    assert run.optimizer_start.adam_step == 0
    assert prepare(megatron, tmp_path, f"model.optimizer_state={megatron['saved']}").optimizer_start.adam_step == 3


def test_optimizer_state_bad_input_refused_in_one_line(megatron, tmp_path):
    """No optimizer state, megatron-core's dp_reshardable format, the legacy per-rank format, a
    non-Adam optimizer (its common state edited: megatron-core's DistributedOptimizer writes Adam's state
    only), LoRA, FSDP, a missing directory: one line each, before anything is written."""
    not_adam = tmp_path / "not-adam"
    shutil.copytree(megatron["saved"], not_adam)
    # in either layout (inside the DCP files from megatron-core 0.19); written back as common.pt, which every
    # supported release reads first
    common = megatron_versions.read_common_state(not_adam, lambda f: torch.load(f, weights_only=True))
    for group in common["optimizer"]["optimizer"]["param_groups"]:
        del group["betas"]
    torch.save(common, not_adam / megatron_versions.COMMON_PT)
    cases = {
        str(megatron["start"]): "holds no optimizer state",
        str(megatron["dp_reshardable"]): "in the 'dp_reshardable' format: only a DistributedOptimizer's 'fully_reshardable'",
        str(not_adam): "its optimizer is not Adam",
        str(hf_to_megatron(megatron["hf"], tmp_path / "per-rank", fmt="torch", progress=False)): "legacy per-rank format",
    }
    for path, match in cases.items():
        with pytest.raises(ToolkitError, match=match) as refused:
            prepare(megatron, tmp_path, f"model.optimizer_state={path}")
        assert "\n" not in str(refused.value)
    for override in ("peft.enabled=true", "parallel.dp_engine=fsdp"):
        with pytest.raises(ToolkitError, match=f"with {override.partition('=')[0]}"):
            prepare(megatron, tmp_path, f"model.optimizer_state={megatron['saved']}", override)
    with pytest.raises(ToolkitError, match="not a directory"):
        prepare(megatron, tmp_path, f"model.optimizer_state={tmp_path / 'missing'}")
    assert not (tmp_path / "run").exists(), "nothing written"
