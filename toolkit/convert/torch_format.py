"""Megatron-LM's per-rank `torch` checkpoint format.

    release/mp_rank_TT/model_optim_rng.pt        (PP == 1)
    release/mp_rank_TT_PPP/model_optim_rng.pt    (PP > 1)

Each file is {"model": state dict with PP-stage-local layer numbers, "args": Namespace,
"checkpoint_version": 3.0, "iteration": 0}. Files are read with torch.load(weights_only=True),
allowing only the non-tensor types these files carry (SAFE_GLOBALS), and memory-mapped.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.utils.serialization

from toolkit.convert import naming
from toolkit.convert.metadata import CHECKPOINT_VERSION
from toolkit.errors import ConversionError
from toolkit.layouts import Layout

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3})?")
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
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConversionError(f"{path} cannot be read as a torch checkpoint: {e}") from None


class _HashingFile:
    """File wrapper that hashes bytes as torch.save writes them (torch.save writes sequentially),
    so the checksum costs no second read of the file."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_with_sha256(obj, path: Path) -> str:
    """torch.save without the zip CRC32 (about 40% of save time; sha256 covers integrity),
    returning the file's sha256."""
    config = torch.utils.serialization.config.save
    saved_crc, config.compute_crc32 = config.compute_crc32, False
    try:
        with open(path, "wb") as f:
            writer = _HashingFile(f)
            torch.save(obj, writer)
    finally:
        config.compute_crc32 = saved_crc
    return writer.digest.hexdigest()


def rank_file(release: Path, layout: Layout, tp_rank: int, pp_rank: int) -> Path:
    return release / layout.rank_dir(tp_rank, pp_rank) / RANK_FILE


def save_rank_file(path: Path, model: dict, args: argparse.Namespace, layer_spec: str, num_stage_layers: int) -> str:
    """Write one rank's file from canonical names (stage-local layer numbers); returns its sha256."""
    named = {naming.to_spec_name(name, layer_spec): t for name, t in model.items()}
    for layer in range(num_stage_layers):
        for module in naming.EXTRA_STATE_MODULES:
            named[naming.layer_name(layer, f"{module}._extra_state")] = None
    path.parent.mkdir(parents=True)
    state = {"model": named, "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    return save_with_sha256(state, path)


def write_rank_files(
    release: Path,
    layout: Layout,
    build_stage: Callable[[int, int], Iterator[tuple[str, torch.Tensor]]],
    num_stage_layers: int,
    layer_spec: str,
    args: argparse.Namespace,
) -> dict[Path, str]:
    """One file per (TP, PP) rank, written as soon as it is complete; returns {path: sha256}.

    build_stage(tp_rank, pp_rank) yields (canonical name with stage-local layer number, tensor).
    """
    checksums = {}
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            path = rank_file(release, layout, tp_rank, pp_rank)
            model = dict(build_stage(tp_rank, pp_rank))
            checksums[path] = save_rank_file(path, model, args, layer_spec, num_stage_layers)
            del model
    return checksums


def discover_layout(release: Path) -> tuple[int, int]:
    """(TP, PP) from the mp_rank_* directory names of a per-rank checkpoint."""
    dirs = [d.name for d in release.glob("mp_rank_*") if (d / RANK_FILE).is_file()]
    if not dirs:
        raise ConversionError(f"{release} holds no mp_rank_*/{RANK_FILE} files")
    odd = [d for d in dirs if not _RANK_DIR.fullmatch(d)]
    if odd:
        raise ConversionError(f"{release / odd[0]} is not a Megatron-LM rank directory name (mp_rank_TT or mp_rank_TT_PPP)")
    parts = [d.split("_")[2:] for d in dirs]
    tp = 1 + max(int(p[0]) for p in parts)
    pp = 1 + max(int(p[1]) for p in parts) if len(parts[0]) > 1 else 1
    if len(dirs) != tp * pp:
        raise ConversionError(f"{release} has {len(dirs)} rank files, expected TP*PP = {tp}*{pp}")
    return tp, pp


def read_stage(release: Path, layout: Layout, pp_rank: int,
               before_load: Callable[[Path], None] = lambda path: None) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's model state for one stage, memory-mapped, in canonical names.
    `before_load(path)` runs before each file is loaded (the checksum check)."""
    out = []
    for tp_rank in range(layout.tp):
        before_load(rank_file(release, layout, tp_rank, pp_rank))
        state = load_trusted_types(rank_file(release, layout, tp_rank, pp_rank))
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise ConversionError(f"{rank_file(release, layout, tp_rank, pp_rank)} has no 'model' entry")
        out.append(
            {
                naming.to_canonical(k): v
                for k, v in state["model"].items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
            }
        )
    return out
