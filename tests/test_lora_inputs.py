"""LoRA's bad input: each one line, before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.finetune_harness import recipe, write_peft_adapter, write_uneven_data
from toolkit.convert import hf_to_megatron
from toolkit.errors import ToolkitError


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("lora-inputs")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=2, vocab_size=250)
    other = make_tiny_model("llama-odd-vocab", root / "hf-other", dtype="float32", num_hidden_layers=2, vocab_size=250,
                            seed=5)
    return {
        "hf": hf,
        "mc": hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False),
        "mc-other": hf_to_megatron(other, root / "mc-other", fmt="torch_dist", progress=False),
        "data": write_uneven_data(root / "data.jsonl", 40),
    }


def recipe_module():
    """recipes/finetune.py, whose prepare() makes every check that needs no process."""
    import importlib.util
    import sys

    from tests.finetune_harness import RECIPE

    if "finetune_recipe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["finetune_recipe"]


def prepare(base, tmp_path, *overrides, checkpoint="mc"):
    module = recipe_module()
    cfg = recipe(tmp_path, base[checkpoint], base["data"])
    return module.prepare(str(cfg), ["peft.enabled=true", *overrides])


def refused(base, tmp_path, match, *overrides, checkpoint="mc"):
    with pytest.raises(ToolkitError, match=match) as info:
        prepare(base, tmp_path, *overrides, checkpoint=checkpoint)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists(), "nothing may be written"


def test_target_module_the_family_lacks_is_refused(base, tmp_path):
    refused(base, tmp_path, "w_proj not in the llama family", "peft.target_modules=q_proj,w_proj")


@pytest.mark.parametrize("r, match", [(0, "r=0 must be between 1 and 32"), (33, "r=33 must be between 1 and 32")])
def test_rank_out_of_range_is_refused(base, tmp_path, r, match):
    """The tiny model's smallest target dimension is the 32 rows of k_proj/v_proj (2 kv heads x 16)."""
    refused(base, tmp_path, match, f"peft.r={r}")


def test_accepted_settings_pass(base, tmp_path):
    run = prepare(base, tmp_path, "peft.r=32", "peft.target_modules=all-linear")
    assert run.lora.settings.r == 32
    # all-linear spelled out: PEFT reads target_modules back as module names
    assert sorted(run.lora.settings.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_adapter_of_another_base_checkpoint_is_refused(base, tmp_path):
    """An adapter that records its base (toolkit_base.json) loads only onto that checkpoint."""
    from toolkit.lora import peft_dir

    adapter = write_peft_adapter(base["hf"], tmp_path / "adapter", ["q_proj"])
    (adapter / peft_dir.BASE).write_text(json.dumps(peft_dir.base_reference(base["mc-other"])))
    refused(base, tmp_path, "was trained on .*mc-other", f"peft.init_from={adapter}")
    prepare(base, tmp_path, f"peft.init_from={adapter}", checkpoint="mc-other")  # its own base: accepted


def test_adapter_that_does_not_fit_the_model_is_refused(base, tmp_path):
    adapter = write_peft_adapter(base["hf"], tmp_path / "adapter", ["q_proj"], r=4)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    refused(base, tmp_path, "does not fit this model and LoRA config", f"peft.init_from={adapter}")


def test_adapter_export_from_a_run_without_adapter_is_refused(base, tmp_path, capsys):
    from toolkit.cli import main as cli

    step = tmp_path / "run" / "checkpoints" / "step_0000001"
    shutil.copytree(base["mc"], step / "model")  # a full fine-tune's checkpoint holds model/, no adapter/
    assert cli(["convert", "megatron-to-hf", "--adapter", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no LoRA adapter" in err, err
    assert not (tmp_path / "out").exists()


def test_init_from_without_peft_enabled_is_refused(base, tmp_path):
    adapter = write_peft_adapter(base["hf"], tmp_path / "adapter", ["q_proj"])
    refused(base, tmp_path, "peft.enabled is false", "peft.enabled=false", f"peft.init_from={adapter}")


def test_the_default_targets_on_nemotron_h_are_refused_as_peft_refuses_them(tmp_path):
    """peft.target_modules' default, all-linear, takes Mamba-2's out_proj, which PEFT refuses on Mamba-based models:
    refused in one line naming the modules to list, before anything is written; those listed, the recipe prepares."""
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("nemotron-h", tmp_path / "hf", dtype="float32", vocab_size=250)
    base = {"mc": hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False),
            "data": write_uneven_data(tmp_path / "data.jsonl", 40)}
    for run in ("default", "conv", "listed"):
        (tmp_path / run).mkdir()
    refused(base, tmp_path / "default", r"^peft.target_modules=all-linear on nemotron_h takes out_proj: PEFT refuses "
            r".*name the others instead: peft.target_modules=in_proj,q_proj,k_proj,v_proj,o_proj,up_proj,down_proj$")
    refused(base, tmp_path / "conv", r"^LoRA on conv1d of nemotron_h is not supported: .*leave it out of "
            r"peft.target_modules$", "peft.target_modules=in_proj,conv1d")
    prepare(base, tmp_path / "listed", "peft.target_modules=in_proj,q_proj,k_proj,v_proj,o_proj,up_proj,down_proj")
