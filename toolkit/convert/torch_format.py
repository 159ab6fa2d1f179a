"""Megatron-LM's per-rank `torch` checkpoint format.

    release/mp_rank_TT/model_optim_rng.pt        (PP == 1)
    release/mp_rank_TT_PPP/model_optim_rng.pt    (PP > 1)

Each file is {"model": state dict with PP-stage-local layer numbers, "args": Namespace,
"checkpoint_version": 3.0, "iteration": 0}. Files are read with torch.load(weights_only=True),
allowing only the non-tensor types these files carry (SAFE_GLOBALS), and memory-mapped.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Callable, Iterator

import torch

from toolkit.convert import naming
from toolkit.convert.metadata import CHECKPOINT_VERSION
from toolkit.errors import ConversionError
from toolkit.layouts import Layout

RANK_FILE = "model_optim_rng.pt"
# The only non-tensor, non-builtin type in the files we write (Megatron-LM's `args`).
SAFE_GLOBALS = [argparse.Namespace]


def load_trusted_types(path: Path, mmap: bool = True) -> dict:
    """torch.load without unrestricted unpickling: tensors, builtins and SAFE_GLOBALS only."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[-1][:300]
        raise ConversionError(
            f"{path} contains objects outside the allow-list and was not unpickled ({first_line}). "
            "Only load checkpoints from sources you trust."
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ConversionError(f"{path} cannot be read as a torch checkpoint: {e}") from None


def rank_file(release: Path, layout: Layout, tp_rank: int, pp_rank: int) -> Path:
    return release / layout.rank_dir(tp_rank, pp_rank) / RANK_FILE


def write_rank_files(
    release: Path,
    layout: Layout,
    build_stage: Callable[[int, int], Iterator[tuple[str, torch.Tensor]]],
    num_stage_layers: int,
    layer_spec: str,
    args: argparse.Namespace,
    on_file: Callable[[Path], None] = lambda p: None,
) -> None:
    """One file per (TP, PP) rank, written as soon as it is complete.

    build_stage(tp_rank, pp_rank) yields (canonical name with stage-local layer number, tensor).
    """
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            model = {naming.to_spec_name(name, layer_spec): t for name, t in build_stage(tp_rank, pp_rank)}
            for layer in range(num_stage_layers):
                for module in naming.EXTRA_STATE_MODULES:
                    model[naming.layer_name(layer, f"{module}._extra_state")] = None
            path = rank_file(release, layout, tp_rank, pp_rank)
            path.parent.mkdir(parents=True)
            torch.save(
                {"model": model, "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, path
            )
            del model
            on_file(path)


def discover_layout(release: Path) -> tuple[int, int]:
    """(TP, PP) from the mp_rank_* directory names of a per-rank checkpoint."""
    dirs = [d.name for d in release.glob("mp_rank_*") if (d / RANK_FILE).is_file()]
    if not dirs:
        raise ConversionError(f"{release} holds no mp_rank_*/{RANK_FILE} files")
    parts = [d.split("_")[2:] for d in dirs]
    tp = 1 + max(int(p[0]) for p in parts)
    pp = 1 + max(int(p[1]) for p in parts) if len(parts[0]) > 1 else 1
    if len(dirs) != tp * pp:
        raise ConversionError(f"{release} has {len(dirs)} rank files, expected TP*PP = {tp}*{pp}")
    return tp, pp


def read_stage(release: Path, layout: Layout, pp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's model state for one stage, memory-mapped, in canonical names."""
    out = []
    for tp_rank in range(layout.tp):
        state = load_trusted_types(rank_file(release, layout, tp_rank, pp_rank))
        if "model" not in state:
            raise ConversionError(f"{rank_file(release, layout, tp_rank, pp_rank)} has no 'model' entry")
        out.append(
            {
                naming.to_canonical(k): v
                for k, v in state["model"].items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
            }
        )
    return out
