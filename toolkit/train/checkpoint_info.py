"""What a training checkpoint holds and where it can resume (`toolkit ckpt inspect DIR`),
read from its files alone: no process group, no tensor data."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ConversionError
from toolkit.layouts import Layout
from toolkit.runtime import megatron_versions
from toolkit.train import checkpoint, elastic

MAX_PARALLEL = 64  # TP / PP sizes listed as resumable, at most


def resolve(path: Path) -> Path:
    """A step directory, or the one `latest` names in a run directory (or its checkpoints/)."""
    path = Path(path)
    if (path / "train_state.json").is_file():
        return path
    for run_dir in (path, path.parent):
        if (run_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).is_file():
            return checkpoint.find_latest(run_dir)
    raise checkpoint.CheckpointError(f"{path} is neither a training checkpoint (no train_state.json) nor a run directory")


def _divisors(n: int, limit: int = MAX_PARALLEL) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def resumable_layouts(meta: CheckpointMeta, global_batch: int | None) -> dict[str, list[int]]:
    """TP and PP sizes megatron-core can build for this model, and DP sizes keeping the global batch
    (at micro_batch 1; a larger micro-batch must divide global_batch / DP)."""
    spec = meta.model_spec

    def fits(tp: int, pp: int) -> bool:
        try:
            Layout(tp, pp, meta.vocab_divisor).check(spec)
            return True
        except ConversionError:
            return False

    return {"tp": [t for t in _divisors(spec.num_heads) if fits(t, 1)],
            "pp": [p for p in _divisors(spec.num_layers) if fits(1, p)],
            "dp": _divisors(global_batch, global_batch) if global_batch else []}


def describe(path: Path) -> dict:
    from toolkit.convert.dist_format import tensor_shapes

    step_dir = resolve(path)
    state = json.loads((step_dir / "train_state.json").read_text())
    meta = CheckpointMeta.read(step_dir / "model")
    train_dir = step_dir / elastic.STATE_DIR
    train = elastic.check_files(train_dir)  # its index, read once for the check and the shapes
    samples, seq_len = state.get("consumed_samples"), state.get("seq_len")
    return {
        "checkpoint": str(step_dir),
        "step": state["step"],
        "layout": {k: state.get(k) for k in ("tp", "pp", "dp", "zero_stage")},
        "global_batch": state.get("global_batch"),
        "samples_seen": samples,
        "tokens_seen_padded": samples * seq_len if samples is not None and seq_len else None,
        "model": {k: meta.spec.get(k) for k in ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                               "vocab_size")},
        "tensors": {k: [list(shape), str(dtype).removeprefix("torch.")]
                    for k, (shape, dtype) in tensor_shapes(train).items()},
        "resumable": resumable_layouts(meta, state.get("global_batch")),
        "torch_dist_layout": {name: where for name in ("model", elastic.STATE_DIR)
                              if (where := megatron_versions.common_layout(step_dir / name))},
    }


def lines(info: dict) -> list[str]:
    layout, r = info["layout"], info["resumable"]
    out = [
        f"checkpoint {info['checkpoint']}: step {info['step']}, written at TP {layout['tp']} x PP {layout['pp']} x "
        + (f"DP {layout['dp']}, ZeRO-{layout['zero_stage']}" if layout["dp"] else "any DP and ZeRO stage (resharded)"),
        f"global batch {info['global_batch']}; samples seen {info['samples_seen']}; "
        f"tokens seen (padded) {info['tokens_seen_padded']}",
        "model " + ", ".join(f"{k} {v}" for k, v in info["model"].items()),
        f"resumes at TP in {r['tp']}, PP in {r['pp']}, DP in {r['dp']} (DP x micro_batch must divide the global batch), "
        "any ZeRO stage 1-3 (2/3 with PP 1)",
        f"{len(info['tensors'])} tensors (global shapes):",
    ]
    out += [f"torch_dist {name}/: non-tensor state in {where}" for name, where in info["torch_dist_layout"].items()]
    out += [f"  {key} {shape} {dtype}" for key, (shape, dtype) in sorted(info["tensors"].items())]
    return out
