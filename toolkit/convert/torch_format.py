"""Megatron-LM's per-rank `torch` checkpoint format.

    release/mp_rank_TT/model_optim_rng.pt          (PP == 1)
    release/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1)
    release/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt (expert parallelism: EP rank appended when EP > 1)

With EP > 1 every file holds its TP rank's dense tensors (the same in every EP rank's file) and
its EP rank's experts, numbered from 0 on the rank, as Megatron-LM saves them.

Each file is {"model": state dict with PP-stage-local layer numbers, "args": Namespace,
"checkpoint_version": 3.0, "iteration": 0}. Files are read with torch.load(weights_only=True),
allowing only the non-tensor types these files carry (SAFE_GLOBALS), and memory-mapped.
"""

from __future__ import annotations

import argparse
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from toolkit.convert import naming
from toolkit.convert.metadata import CHECKPOINT_VERSION
from toolkit.convert.torch_stream import HashingWriter, save_streaming, without_zip_crc32
from toolkit.errors import ConversionError
from toolkit.layouts import Layout

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")
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


def save_with_checksum(obj, path: Path) -> str:
    """torch.save without the zip CRC32, returning the file's checksum (toolkit.checksum)."""
    with open(path, "wb") as f, without_zip_crc32():
        writer = HashingWriter(f)
        torch.save(obj, writer)
    return writer.digest.hexdigest()


def rank_file(release: Path, layout: Layout, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
    return release / layout.rank_dir(tp_rank, pp_rank, ep_rank) / RANK_FILE


def _rank_state(model: dict, args: argparse.Namespace, layer_spec: str, num_stage_layers: int,
                local_experts: int) -> dict:
    """One rank file's contents from canonical names (stage-local layer numbers)."""
    moe = naming.router_layers(model)
    named = {naming.to_spec_name(name, layer_spec, moe=naming.split_layer(name)[0] in moe): t for name, t in model.items()}
    shared = any(naming.split_layer(name)[1].startswith(naming.SHARED_EXPERT_PREFIX) for name in model)
    hybrid = naming.hybrid_symbols(model)  # a hybrid model's layers: each kind's linears (Nemotron-H)
    named.update(dict.fromkeys(naming.hybrid_extra_state_names(hybrid, local_experts) if hybrid else naming.extra_state_names(
        num_stage_layers, local_experts, layer_spec, shared, moe, naming.attention_linears(model), naming.gdn_layers(model))))
    return {"model": named, "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}


def save_rank_file(path: Path, model: dict, args: argparse.Namespace, layer_spec: str, num_stage_layers: int,
                   local_experts: int = 0) -> str:
    """Write one rank file from tensors in memory; returns its checksum."""
    path.parent.mkdir(parents=True)
    return save_with_checksum(_rank_state(model, args, layer_spec, num_stage_layers, local_experts), path)


def stream_rank_file(path: Path, shapes: dict[str, tuple[int, ...]], items: Iterator[tuple[str, object]],
                     args: argparse.Namespace, layer_spec: str, num_stage_layers: int, local_experts: int = 0,
                     dtype: torch.dtype | None = None, suffix_dtypes: Mapping[str, torch.dtype] | None = None) -> str:
    """Write one rank file as `items` yields (canonical name, tensor or its byte ranges) in the
    order of `shapes`, holding one tensor at a time
    (toolkit.convert.torch_stream); returns its checksum. The bytes are those save_rank_file would
    write. `dtype`: every tensor's (None: the first item's, which must then be a tensor) but those
    whose names end with a key of `suffix_dtypes` (the float32 expert bias among bf16 weights)."""
    first = [next(items)]  # handed on, not kept
    dtype = first[0][1].dtype if dtype is None else dtype
    def dtype_of(name: str) -> torch.dtype:
        return next((d for suffix, d in (suffix_dtypes or {}).items() if name.endswith(suffix)), dtype)

    placeholders = {name: torch.empty(shape, dtype=dtype_of(name)) for name, shape in shapes.items()}

    def in_order():
        expected = iter(placeholders)
        item = first.pop()
        while item is not None:
            name, tensor = item
            laid_out = next(expected, None)
            if name != laid_out:
                raise RuntimeError(f"{path}: built {name!r} where {laid_out!r} was laid out")
            yield tensor
            del item, tensor  # before the next is built
            item = next(items, None)
        if next(expected, None) is not None:
            raise RuntimeError(f"{path}: fewer tensors built than laid out")

    path.parent.mkdir(parents=True)
    state = _rank_state(placeholders, args, layer_spec, num_stage_layers, local_experts)
    return save_streaming(state, list(placeholders.values()), in_order(), path)


def write_rank_files(
    release: Path,
    layout: Layout,
    build_stage: Callable[[int, int, int], Iterator[tuple[str, object]]],
    stage_shapes: Callable[[int], dict[str, tuple[int, ...]]],
    num_stage_layers: int,
    layer_spec: str,
    args: argparse.Namespace,
    local_experts: int = 0,
    *,
    dtype: torch.dtype | None = None,
    suffix_dtypes: Mapping[str, torch.dtype] | None = None,
    file_threads: int = 1,
) -> dict[Path, str]:
    """One file per (TP, PP, EP) rank, each written tensor by tensor; returns {path: checksum}.

    build_stage(tp_rank, pp_rank, ep_rank) yields (canonical name with stage-local layer and
    rank-local expert numbers, tensor or its byte ranges) in the order of stage_shapes(pp_rank),
    the shapes of one rank's tensors: memory holds one tensor per file being written, never a whole rank's experts. `file_threads` files are written at once, where
    build_stage may be called from several threads (copies, writes and hashing release the GIL).
    """
    jobs = {rank_file(release, layout, tp_rank, pp_rank, ep_rank): (tp_rank, pp_rank, ep_rank)
            for pp_rank in range(layout.pp) for tp_rank in range(layout.tp) for ep_rank in range(layout.ep)}

    def write(path: Path) -> str:
        tp_rank, pp_rank, ep_rank = jobs[path]
        return stream_rank_file(path, stage_shapes(pp_rank), iter(build_stage(tp_rank, pp_rank, ep_rank)), args,
                                layer_spec, num_stage_layers, local_experts, dtype, suffix_dtypes)

    with ThreadPoolExecutor(max_workers=file_threads, thread_name_prefix="rank-file") as pool:
        return dict(zip(jobs, pool.map(write, jobs)))


def discover_layout(release: Path, second_is_expert: bool = False) -> tuple[int, int, int]:
    """(TP, PP, EP) from the mp_rank_* directory names of a per-rank checkpoint. Megatron-LM's
    mp_rank_TT_NNN is ambiguous (a PP rank, or an EP rank at PP 1): `second_is_expert` settles it."""
    dirs = [d.name for d in release.glob("mp_rank_*") if (d / RANK_FILE).is_file()]
    if not dirs:
        raise ConversionError(f"{release} holds no mp_rank_*/{RANK_FILE} files")
    odd = [d for d in dirs if not _RANK_DIR.fullmatch(d)]
    if odd:
        raise ConversionError(f"{release / odd[0]} is not a Megatron-LM rank directory name "
                              "(mp_rank_TT, mp_rank_TT_PPP or mp_rank_TT_PPP_EEE)")
    parts = [[int(x) for x in d.split("_")[2:]] for d in dirs]
    if len({len(p) for p in parts}) > 1:
        raise ConversionError(f"{release} mixes rank directory names of different layouts")
    if len(parts[0]) == 2 and second_is_expert:
        parts = [[p[0], 0, p[1]] for p in parts]
    tp, pp, ep = (1 + max(p[i] for p in parts) if len(parts[0]) > i else 1 for i in range(3))
    if len(dirs) != tp * pp * ep:
        raise ConversionError(f"{release} has {len(dirs)} rank files, expected TP*PP*EP = {tp}*{pp}*{ep}")
    return tp, pp, ep


def stored_args(release: Path) -> argparse.Namespace | None:
    """Megatron-LM's `args` from one rank file (all hold the same)."""
    first = min(release.glob(f"mp_rank_*/{RANK_FILE}"), default=None)
    return None if first is None else load_trusted_types(first).get("args")


def model_entry(state, path: Path) -> dict:
    """The `model` state of a per-rank file. Megatron-LM's files of a virtual (interleaved) pipeline
    hold `model0`, `model1`, ... instead, one per chunk, with non-contiguous layers per file: refused
    (the toolkit's own interleaved runs write each chunk as a stage of a PP x VPP pipeline)."""
    if isinstance(state, dict) and "model" not in state and "model0" in state:
        raise ConversionError(f"{path} is a Megatron-LM virtual-pipeline file (model0, model1, ...), which is not read: "
                              "convert it with Megatron-LM to torch_dist (layout-independent) first")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ConversionError(f"{path} has no 'model' entry")
    return state["model"]


def read_stage(release: Path, layout: Layout, pp_rank: int,
               before_load: Callable[[Path], None] = lambda path: None, ep_rank: int = 0) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's model state for one stage (and EP rank), memory-mapped, in canonical names.
    `before_load(path)` runs before each file is loaded (the checksum check)."""
    out = []
    for tp_rank in range(layout.tp):
        path = rank_file(release, layout, tp_rank, pp_rank, ep_rank)
        before_load(path)
        model = model_entry(load_trusted_types(path), path)
        canonical = naming.canonical_names(model)
        out.append(
            {
                canonical[k]: v
                for k, v in model.items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
            }
        )
    return out
