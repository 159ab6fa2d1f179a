"""megatron-core checkpoint -> HF directory (safetensors, sharded with an index when large)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from toolkit.atomic import atomic_directory, refuse_output_overlapping_inputs
from toolkit.convert import ignored
from toolkit.convert.consistency import expected_hf_tensors
from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
from toolkit.convert.progress import progress_bar
from toolkit.errors import ConversionError
from toolkit.families.float32 import export_cast

DEFAULT_MAX_SHARD_BYTES = 4 << 30


class SafetensorsShardWriter:
    """Collects tensors into files of at most `max_bytes` (one tensor may exceed it) and writes
    each file as soon as it is full, so memory holds at most one file's tensors."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.dir, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.dir / f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, path, metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            os.rename(self.files[0][0], self.dir / "model.safetensors")
            return
        weight_map, total = {}, 0
        n = len(self.files)
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            total += path.stat().st_size
            os.rename(path, self.dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def export_bytes(ckpt: MegatronCheckpoint, dtype: torch.dtype | None, wrapped=None) -> int:
    """About what the exported HF directory takes on disk: the weights in the export dtype plus
    the copied config and tokenizer files (and a wrapper's other tensors and files)."""
    itemsize = (dtype or torch.float32).itemsize
    weights = sum(math.prod(shape) for shape in expected_hf_tensors(ckpt.family, ckpt.spec).values()) * itemsize
    if wrapped is not None:
        weights += sum(wrapped.whole.tensors[n].nbytes for n in wrapped.other_tensors())
        weights += sum(f.stat().st_size for f in _wrapper_files(wrapped, {f.name for f in ckpt.tokenizer_files}))
    return weights + len(ckpt.config_bytes) + sum(f.stat().st_size for f in ckpt.tokenizer_files)


def _open_wrapper(wrapper, ckpt: MegatronCheckpoint):
    """The multimodal checkpoint to export into, refused unless its language model is the checkpoint's."""
    from toolkit.convert.consistency import check_spec_matches_config
    from toolkit.convert.hf_config import checked_spec
    from toolkit.convert.wrapper import open_wrapper

    wrapped = open_wrapper(wrapper)
    config = wrapped.dir / "config.json"
    _, spec = checked_spec(wrapped.config, config, wrapped.tensors)
    check_spec_matches_config(ckpt.spec, spec, ckpt.root, config)
    return wrapped


def _wrapper_files(wrapped, skip: set[str] = frozenset()) -> list[Path]:
    """The wrapper's files besides its weights, config.json and `skip` (processor, chat template,
    generation config), copied beside the weights."""
    if wrapped is None:
        return []
    return sorted(f for f in wrapped.dir.iterdir() if f.is_file() and f.name != "config.json" and f.name not in skip
                  and not f.name.endswith((".safetensors", ".safetensors.index.json")))


def _hf_layout(ckpt: MegatronCheckpoint, transform, fuse: bool = False):
    """(HF name, tensor) as HF stores them: `transform`ed, and experts fused per layer where the family
    exports them so (FusedExperts.export_fused: gpt-oss; toolkit/convert/fused_experts.py) or `fuse` says (a
    wrapper whose files hold them fused: Wrapper.experts_as_stored), read one layer's experts at a time."""
    def read(wanted=None):
        return ((n, t if transform is None else transform(n, t)) for n, t in ckpt.hf_tensors(wanted))

    fused = ckpt.family.fused_experts
    if fused is None or not (fused.export_fused or fuse):  # Qwen3.5-MoE: per expert, as transformers saves it
        return read()
    from toolkit.convert.fused_experts import fused_layers

    return fused_layers(fused, ckpt.spec.num_experts, expected_hf_tensors(ckpt.family, ckpt.spec), read)


def megatron_to_hf(
    megatron_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config: str | os.PathLike | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool | None = None,
    transform=None,
    wrapper: str | os.PathLike | None = None,
) -> Path:
    """Merge the TP x PP shards of `megatron_dir` into an HF checkpoint at `out_dir`.
    `transform(hf_name, tensor)`, if given, changes each tensor before the cast to the source
    dtype (toolkit.lora.export merges an adapter in this way). `wrapper`: the multimodal
    checkpoint the language model was converted from (toolkit/convert/wrapper.py), to write it back
    into: its config and every tensor outside the language model copied as they are.

    Every shard is checked against the checksum in the metadata as it is read, and the metadata
    against the HF config and the shards; the result appears at `out_dir` only when complete."""
    if not max_shard_bytes > 0:
        raise ConversionError(f"the maximum shard size must be > 0 bytes (got {max_shard_bytes})")
    ckpt = MegatronCheckpoint.open(megatron_dir, hf_config)  # reads only
    # The directory actually read: a run directory's export may go inside it (RUN_DIR/hf).
    refuse_output_overlapping_inputs(out_dir, ckpt.root, hf_config, wrapper)
    wrapped = None if wrapper is None else _open_wrapper(wrapper, ckpt)
    outer = (lambda name: name) if wrapped is None else wrapped.wrapper.wrapper_name  # noqa: E731
    # Training checkpoints hold fp32 master weights: export in the source checkpoint's dtype, but the tensors
    # transformers keeps in float32 (the router and its expert bias: rounding them changes the routing) as a
    # conversion stored them, or as the installed class keeps them (toolkit/families/float32.py)
    dtype = getattr(torch, ckpt.spec.dtype, None)
    cast = export_cast(ckpt.family, dtype, as_stored=ckpt.meta is not None and not ckpt.meta.master_weights)
    with atomic_directory(out_dir, overwrite, needed_bytes=export_bytes(ckpt, dtype, wrapped)) as tmp:
        writer = SafetensorsShardWriter(tmp, max_shard_bytes)
        with progress_bar(None, "merging shards", progress) as bar:
            fuse = wrapped is not None and wrapped.wrapper.experts_as_stored and wrapped.holds_fused_experts
            for name, tensor in _hf_layout(ckpt, transform, fuse):
                writer.add(outer(name), cast(name, tensor))
                bar.update(1)
            for name in [] if wrapped is None else wrapped.other_tensors():
                writer.add(name, wrapped.whole.read(name))  # the stored bytes, never cast
                bar.update(1)
        writer.close()
        (tmp / "config.json").write_bytes(ckpt.config_bytes if wrapped is None else wrapped.whole.config_bytes)
        for f in ckpt.tokenizer_files + _wrapper_files(wrapped, skip={f.name for f in ckpt.tokenizer_files}):
            shutil.copyfile(f, tmp / f.name)
    _say_left_out(ckpt, wrapped)
    return Path(out_dir)


def _say_left_out(ckpt: MegatronCheckpoint, wrapped) -> None:
    """One line for the tensors HF's model ignores on load that the export does not write: those the
    conversion left out (CheckpointMeta.ignored), or where it writes into a wrapper those of the wrapper's
    files (toolkit/convert/ignored.py)."""
    if wrapped is not None:
        counts = {kind: len(names) for kind, names in wrapped.ignored.items()}
    else:
        counts = dict(ckpt.meta.ignored) if ckpt.meta is not None else {}
    if counts:
        listed = ", ".join(f"{n} {ignored.KIND_NAMES[kind]}" for kind, n in sorted(counts.items()))
        print(f"note: not written, as HF's model ignores them on load: {listed} of the HF checkpoint", file=sys.stderr)
