"""`toolkit ckpt reshard DIR OUT --tp --pp [--ep]`: a training checkpoint rewritten for another TP x PP (x EP),
offline (one process, no process group), as a run directory that `resume=auto` continues.

    OUT/checkpoints/latest
    OUT/checkpoints/step_0000010/
      train/              the layout-independent fp32 master weights and Adam moments, copied file
                          by file (torch_dist global tensors: already readable at any layout)
      model/              the fp32 weights in our per-rank format at the new TP x PP (what `toolkit
                          convert megatron-to-hf` and `ckpt inspect` read), written tensor by tensor,
                          each shard copied from the memory-mapped stored shards and written before
                          the next is built: memory holds one tensor shard (toolkit.convert.reslice)
      train_state.json    the step, LR schedule, data position and global batch, with the new TP and PP

DeepSpeed's files (ds/) and the per-rank RNG states (ranks/) belong to the old layout and are left
out: the resumed run loads train/ on whatever DP and ZeRO stage it gets (train_state.json names none,
so no layout counts as the writer's), and re-seeds its RNG from the config as any elastic resume does.
OUT is built under a temporary name and renamed into place only when complete (toolkit.atomic).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toolkit.atomic import atomic_directory, refuse_output_overlapping_inputs
from toolkit.convert import torch_format
from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
from toolkit.convert.metadata import HF_DIR, RELEASE, TRACKER, CheckpointMeta
from toolkit.convert.reslice import Resharder
from toolkit.layouts import Layout
from toolkit.megatron_settings import megatron_args
from toolkit.train import checkpoint, elastic
from toolkit.train.checkpoint import CheckpointError
from toolkit.train.checkpoint_info import resolve

LAYER_SPEC = "local"  # what a fine-tune's model/ holds (checkpoint._write_model)


def reshard(source: str | Path, out: str | Path, tp: int, pp: int, overwrite: bool = False, ep: int | None = None) -> Path:
    """Write OUT (a run directory) from the checkpoint `source` (a step directory, or a run
    directory's latest) for TP x PP and, for a Mixture-of-Experts model, EP (default: the
    checkpoint's). Everything is checked before anything is written."""
    step_dir = resolve(Path(source))
    state = checkpoint._train_state(step_dir)
    model = _checked_source(step_dir, state)  # opened and validated once, passed along
    meta = model.meta
    layout = Layout(tp, pp, meta.vocab_divisor, meta.ep if ep is None else ep)
    layout.check(meta.model_spec)  # TP dividing the heads, PP the layers: one line otherwise
    refuse_output_overlapping_inputs(out, step_dir)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        target = tmp / checkpoint.CHECKPOINTS / step_dir.name
        _copy_files(step_dir / elastic.STATE_DIR, target / elastic.STATE_DIR)
        reshard_model(model, target / "model", layout)
        resharded = {**state, "tp": tp, "pp": pp, "dp": None, "zero_stage": None,
                     **({"ep": layout.ep} if meta.model_spec.is_moe else {})}
        (target / "train_state.json").write_text(json.dumps(resharded, indent=2))
        (tmp / checkpoint.CHECKPOINTS / checkpoint.LATEST).write_text(step_dir.name)
    return Path(out)


def _checked_source(step_dir: Path, state: dict) -> MegatronCheckpoint:
    if (step_dir / checkpoint.ADAPTER_EXPORT).is_dir():
        raise CheckpointError(f"{step_dir} is a LoRA checkpoint: an adapter resumes on its own layout only, "
                              "there is nothing to reshard")
    if "consumed_samples" not in state:
        raise CheckpointError(f"{step_dir} was written by an earlier version without a layout-independent state "
                              "(train/): it cannot be resharded")
    elastic.check_files(step_dir / elastic.STATE_DIR)  # a missing or truncated shard: one line
    model = MegatronCheckpoint.open(step_dir / "model")
    if model.fmt != "torch":  # what checkpoint._write_model writes; resliced as per-rank files
        raise CheckpointError(f"{step_dir / 'model'} is in the {model.fmt} format, not the per-rank torch files "
                              "a fine-tuning checkpoint holds: it cannot be resharded")
    return model


def _copy_files(source: Path, target: Path) -> None:
    """File by file; shutil.copyfile moves the bytes in the kernel (sendfile), never whole in memory."""
    for path in sorted(source.rglob("*")):
        if path.is_file():
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)


def reshard_model(source: MegatronCheckpoint, target: Path, layout: Layout) -> None:
    """Each rank file of the new layout, tensor by tensor, each copied from the stored shards as it
    is written (toolkit.convert.reslice)."""
    meta, spec = source.meta, source.spec
    args = megatron_args(spec, layout, "torch")
    layers = spec.num_layers // layout.pp
    resharder = Resharder(source, layout)
    sums = torch_format.write_rank_files(target / RELEASE, layout, resharder.rank_tensors, resharder.shapes, layers,
                                         LAYER_SPEC, args, len(layout.local_experts(spec, 0)))
    new = CheckpointMeta(**{**meta.__dict__, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
                            "checksums": {str(path.relative_to(target)): digest for path, digest in sums.items()}})
    new.write(target)
    (target / TRACKER).write_text(RELEASE)
    shutil.copytree(source.root / HF_DIR, target / HF_DIR)
