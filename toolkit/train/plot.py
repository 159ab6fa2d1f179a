"""Loss curves of a run, from RUN_DIR/metrics.jsonl, drawn to a PNG (matplotlib is an optional extra)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from toolkit.atomic import write_file
from toolkit.errors import ToolkitError


def loss_figure(run_dir: str | Path):
    """The figure of RUN_DIR/metrics.jsonl: one line per curve (loss, eval_loss), labelled by key."""
    run_dir = Path(run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ToolkitError(f"{run_dir} has no metrics.jsonl")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ToolkitError("plotting needs matplotlib: pip install 'megatron-ds-toolkit[plot]'") from None
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
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


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    fig = loss_figure(run_dir)  # imports matplotlib, or says how to install it
    import matplotlib.pyplot as plt

    out = Path(out) if out else Path(run_dir) / "loss.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return write_file(out, png.getvalue(), Path(run_dir) / "metrics.jsonl")
