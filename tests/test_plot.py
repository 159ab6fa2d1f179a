"""`toolkit plot RUN_DIR`: the PNG exists, is a real PNG, and its figure holds the run's curves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toolkit.errors import ToolkitError
from toolkit.train.plot import loss_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSSES = [(1, 3.0), (2, 2.5), (3, 2.1), (4, 1.8)]
EVAL = [(2, 2.7), (4, 2.0)]


@pytest.fixture
def run_dir(tmp_path):
    rows = [{"step": s, "loss": loss, "lr": 1e-4} for s, loss in LOSSES]
    for step, value in EVAL:
        rows[step - 1]["eval_loss"] = value
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_figure_has_the_loss_and_eval_curves_point_for_point(run_dir):
    import matplotlib.pyplot as plt

    fig = loss_figure(run_dir)
    lines = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in fig.axes[0].get_lines()}
    plt.close(fig)
    assert lines == {"loss": LOSSES, "eval_loss": EVAL}


def test_cli_writes_a_png_of_the_figure(run_dir):
    result = subprocess.run([sys.executable, "-m", "toolkit", "plot", str(run_dir)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    png = run_dir / "loss.png"
    assert result.stdout.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
    assert width > 300 and height > 200, (width, height)  # a 7 x 4 in figure at 100 dpi, trimmed


def test_run_without_metrics_is_one_line_error(tmp_path):
    with pytest.raises(ToolkitError, match="no metrics.jsonl"):
        loss_figure(tmp_path)


def test_expert_load_heat_map_is_the_last_logged_step_and_flattens_for_wandb(tmp_path):
    """Tokens per expert per layer (MoE runs): the heat map holds the last logged step's table,
    `toolkit plot` writes it next to loss.png, and W&B gets one scalar per layer and expert."""
    import matplotlib.pyplot as plt

    from toolkit.train.metrics import wandb_record
    from toolkit.train.plot import expert_load_figure, plot_run

    tables = {1: [[5, 1, 2], [0, 4, 4]], 2: [[3, 3, 2], [6, 1, 1]]}
    rows = [{"step": s, "loss": 2.0 / s, "tokens_per_expert": t} for s, t in tables.items()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = expert_load_figure(tmp_path)
    assert fig.axes[0].images[0].get_array().tolist() == tables[2]
    plt.close(fig)
    plot_run(tmp_path)
    assert (tmp_path / "expert_load.png").read_bytes().startswith(PNG_SIGNATURE)
    flat = wandb_record(rows[1])
    assert flat["tokens_per_expert/layer_1/expert_0"] == 6 and "tokens_per_expert" not in flat and flat["loss"] == 1.0


def test_dense_run_has_no_expert_load_heat_map(run_dir):
    from toolkit.train.plot import expert_load_figure, plot_run

    assert expert_load_figure(run_dir) is None
    plot_run(run_dir)
    assert not (run_dir / "expert_load.png").exists()
