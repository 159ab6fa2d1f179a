"""No command writes over what it reads: every output is checked against the command's inputs
(toolkit.atomic.refuse_output_overlapping_inputs) before anything is written, and small files are
written whole or not at all (toolkit.atomic.write_file). Each case failed on the old code by
overwriting its input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.cli import main as toolkit
from toolkit.errors import ToolkitError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model(tmp_path):
    """A copy of a shipped config-only model directory (ds-config and plan read config.json)."""
    return Path(shutil.copytree(ROOT / "ds_configs" / "models" / "llama-3-8b", tmp_path / "model"))


def refused(capsys, *argv) -> str:
    assert toolkit(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "overlaps the input" in err, err
    return err


def test_ds_config_and_plan_refuse_to_write_over_the_model(model, capsys):
    config = model / "config.json"
    before = config.read_bytes()
    refused(capsys, "ds-config", str(model), "--gpus", "8", "-o", str(config))
    refused(capsys, "plan", "--model", str(model), "--gpus", "8", "--gpu-memory", "80GiB", "-o", str(config))
    assert config.read_bytes() == before


def test_plot_refuses_to_write_over_the_metrics(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    before = metrics.read_bytes()
    refused(capsys, "plot", str(tmp_path), "--out", str(metrics))
    assert metrics.read_bytes() == before


def test_slurm_render_refuses_to_write_over_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    shutil.copy(ROOT / "recipes" / "tiny-cpu.yaml", recipe)
    before = recipe.read_bytes()
    refused(capsys, "slurm", "render", "--nodes", "1", "--procs-per-node", "4", "--cpu", "--time", "1:00:00",
            str(recipe), "-o", str(recipe))
    assert recipe.read_bytes() == before


@pytest.mark.parametrize("layout", ["checkpoint-is-the-export", "data-inside-the-checkpoints", "run-inside-the-model"])
def test_a_run_never_writes_over_its_model_or_data(tmp_path, layout):
    from toolkit.train.checkpoint import refuse_outputs_over_inputs

    run_dir, model, data = tmp_path / "run", tmp_path / "ckpt", tmp_path / "data.jsonl"
    if layout == "checkpoint-is-the-export":
        model = run_dir / "hf"
    elif layout == "data-inside-the-checkpoints":
        data = run_dir / "checkpoints" / "data.jsonl"
    else:
        run_dir = model / "run"
    with pytest.raises(ToolkitError, match="overlaps the input"):
        refuse_outputs_over_inputs(run_dir, model, data, None)
    refuse_outputs_over_inputs(tmp_path / "elsewhere", tmp_path / "ckpt", tmp_path / "data.jsonl", None)


def test_memory_and_plan_default_to_the_models_sequence_length(tmp_path, capsys):
    """A model with 64 positions is estimated at 64 tokens, not at an invented 4096; more is refused."""
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", max_position_embeddings=64)
    assert toolkit(["memory", str(hf), "--gpus", "1"]) == 0
    assert "sequence 64," in capsys.readouterr().out
    assert toolkit(["plan", "--model", str(hf), "--gpus", "1", "--gpu-memory", "1GiB", "--seq-len", "100"]) == 2
    assert "--seq-len 100 is outside 1..64" in capsys.readouterr().err
