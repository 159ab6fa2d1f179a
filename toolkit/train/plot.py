"""Loss curves of a run, from RUN_DIR/metrics.jsonl, drawn to a PNG (matplotlib is an optional extra)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from toolkit.atomic import write_file
from toolkit.errors import ToolkitError


def _records_and_pyplot(run_dir: Path):
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ToolkitError(f"{run_dir} has no metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ToolkitError("plotting needs matplotlib: pip install 'megatron-ds-toolkit[plot]'") from None
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line], plt


def loss_figure(run_dir: str | Path):
    """The figure of RUN_DIR/metrics.jsonl: one line per curve (loss, eval_loss), labelled by key."""
    run_dir = Path(run_dir)
    records, plt = _records_and_pyplot(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "eval_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker="." if key == "eval_loss" else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(run_dir.name)
    return fig


EXPERT_LOAD = "tokens_per_expert"


def expert_load_figure(run_dir: str | Path):
    """Heat map of the last logged step's tokens per expert (rows: layers), or None for a dense run."""
    run_dir = Path(run_dir)
    records, plt = _records_and_pyplot(run_dir)
    logged = [r for r in records if EXPERT_LOAD in r]
    if not logged:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    image = ax.imshow(logged[-1][EXPERT_LOAD], aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label="tokens")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"{run_dir.name}: tokens per expert, step {logged[-1]['step']}")
    return fig


def _save(fig, out: Path, run_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return write_file(out, png.getvalue(), run_dir / "metrics.jsonl")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """loss.png (or `out`), and next to it expert_load.png when the run logged tokens per expert."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "loss.png"
    written = _save(loss_figure(run_dir), out, run_dir)  # imports matplotlib, or says how to install it
    heat_map = expert_load_figure(run_dir)
    if heat_map is not None:
        _save(heat_map, out.with_name("expert_load.png"), run_dir)
    return written
