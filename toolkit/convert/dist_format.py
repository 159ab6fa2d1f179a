"""megatron-core's `torch_dist` distributed checkpoint, written and read in one process.

The layout is what `megatron.core.dist_checkpointing.save(model.sharded_state_dict(), dir)`
writes (checked against it in the tests):
  * PyTorch DCP files (`.metadata`, `__0_*.distcp`) plus megatron's `metadata.json` and the non-tensor
    state (`common.pt`, or from megatron-core 0.19 a `common_state` object inside the DCP files);
  * every tensor has its *global* (TP=1) shape, so any TP/PP layout can load it;
  * per-layer tensors are stacked: `decoder.layers.<name>` has shape [num_layers, ...], stored as
    one chunk per layer; fc1 is the global [gate; up]. Not where dense layers are mixed with MoE
    ones (moe_layer_freq as a list): megatron-core then keys every layer on its own,
    `decoder.layers.<i>.<name>` (transformer_block.py:830-868, non_homogeneous_layers);
  * experts are stacked once more, SequentialMLP's sharded keys: `decoder.layers.mlp.experts.experts.
    linear_fc1.weight` has shape [num_layers, num_experts, ...], one chunk per (layer, expert), so
    megatron-core's loader gives each EP rank its experts (and each expert-TP rank its slice);
  * a MoE layer's pre-MLP norm is stored twice (TE_MOE_ALIASES), under each layer spec's key;
  * `_extra_state` entries are byte objects keyed `<name>/shard_<layer>_<num_layers>`;
  * tied output layers are not stored (the last stage loads them from the embedding).

Writing goes through DCP's own FileSystemWriter, under `torch.serialization.skip_data`: DCP lays
out each `.distcp` file (every tensor's zip record, the metadata, the offsets) from placeholder
tensors that are never touched, leaving each record's bytes reserved. The records are then filled
in file order, each from its source byte ranges (copied in the kernel) or from the chunk built in
memory, while a second thread hashes the file behind them (toolkit.convert.torch_stream), so
memory holds about one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from toolkit.convert import naming
from toolkit.convert.torch_stream import fill_records, without_zip_crc32

MCORE_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
STACKED_PREFIX = "decoder.layers."
DCP_METADATA = ".metadata"  # PyTorch DCP's index of every stored tensor
DATA_SUFFIX = ".distcp"  # DCP's data files
# Data files, written (filled and hashed) on a thread each, the chunks spread by size: two, as
# megatron-core's own save writes per rank (TorchDistSaveShardedStrategy's thread_count=2).
DATA_FILES = 2


@dataclass(frozen=True)
class Chunk:
    """One piece of a global tensor: `key` at `offsets`, produced lazily by `load()`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]
    ranges: Callable[[], list | None] = lambda: None  # its bytes in the source files, where known


_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.\d+\.")
EXPERTS_PREFIX = "mlp.experts.experts."  # SequentialMLP's sharded key prefix (experts.py sharded_state_dict)


# Under the TE spec a MoE layer's pre-MLP norm is a module of its own with no key map
# (gpt_layer_specs.py get_gpt_layer_with_transformer_engine_spec: pre_mlp_layernorm=TENorm when
# num_experts), so its sharded key is `pre_mlp_layernorm.weight`; the local spec maps the same norm
# to `mlp.linear_fc1.layer_norm_weight` (its sharded_state_dict_keys_map). A MoE checkpoint holds
# both, so a GPU (TE) model and a CPU (local) model both load it.
_MOE_NORM = "mlp.linear_fc1.layer_norm_weight"
TE_MOE_ALIASES = {STACKED_PREFIX + _MOE_NORM: STACKED_PREFIX + naming.TE_MOE_NORM}


def te_moe_alias(key: str, moe_layers: str | None) -> str | None:
    """The TE spec's key of a MoE layer's pre-MLP norm stored under `key`, or None (not such a norm).
    `moe_layers` as ModelSpec.moe_layers: None, every layer MoE (stacked keys)."""
    if moe_layers is None:
        return TE_MOE_ALIASES.get(key)
    layer, suffix = naming.split_layer(key)
    return naming.layer_name(layer, naming.TE_MOE_NORM) if suffix == _MOE_NORM and moe_layers[layer] == "1" else None


def with_te_moe_aliases(chunks: list[Chunk], moe_layers: str | None = None) -> list[Chunk]:
    return chunks + [dataclasses.replace(c, key=alias) for c in chunks if (alias := te_moe_alias(c.key, moe_layers))]


def layer_key(canonical_layer_name: str, stacked: bool = True) -> str:
    """'decoder.layers.3.mlp.linear_fc2.weight' -> 'decoder.layers.mlp.linear_fc2.weight' (stacked)
    or itself (keyed per layer); 'decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight' ->
    'decoder.layers.mlp.experts.experts.linear_fc2.weight' (or 'decoder.layers.3.mlp.experts.experts...')."""
    layer, suffix = naming.split_layer(canonical_layer_name)
    suffix = _LOCAL_EXPERT.sub(EXPERTS_PREFIX, suffix)
    return STACKED_PREFIX + suffix if stacked else naming.layer_name(layer, suffix)


def row_key(row, layer: int | None, stacked: bool) -> str:
    """The torch_dist key of a family row's tensor on global layer `layer` (Row.dist where megatron-core
    keys it otherwise than its canonical name)."""
    return layer_key(row.dist_name(layer, 0), stacked) if row.per_layer else row.dist_name()


def dist_parts(split, shape: tuple[int, ...], geo) -> list[tuple[str, int, int]]:
    """(key suffix, first row, rows) of each tensor megatron-core's torch_dist stores a TP=1 tensor of
    `shape` as: itself (suffix ""), or its parts each under `<key>.<part>` where the split kind names them
    (`dist_names`: Qwen3-Next's gated delta net in_proj and conv1d, toolkit/splits/gated_delta.py)."""
    suffixes = dist_suffixes(split)
    if suffixes == [""]:
        return [("", 0, shape[0])]
    out, start = [], 0
    for suffix, rows in zip(suffixes, split.parts(shape[0], geo), strict=True):
        out.append((suffix, start, rows))
        start += rows
    return out


def dist_suffixes(split) -> list[str]:
    """The key suffixes of dist_parts, in order."""
    return [f".{name}" for name in getattr(split, "dist_names", ())] or [""]


def stacks_layers(moe_layers: str | None, linear_layers: str | None = None) -> bool:
    """Whether per-layer tensors are stacked over the layers: not where MoE and dense layers mix
    (ModelSpec.moe_layers), nor attention and gated delta net layers (ModelSpec.linear_layers), which
    megatron-core keys each on its own (transformer_block.py:830-868)."""
    return moe_layers is None and linear_layers is None


def stacked_key(canonical_layer_name: str) -> str:
    return layer_key(canonical_layer_name)


class _LazySavePlanner(SavePlanner):
    def __init__(self, chunks: list[Chunk], objects: dict[str, object], on_item: Callable[[], None]):
        self._chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}
        self._objects = objects
        self.on_item = on_item  # called as each chunk's bytes are placed (_FillingFileSystem)
        # Per writing thread (DCP resolves and writes an item on the same thread): the chunks in
        # the order their records were laid out in that thread's data file.
        self._laid_out = threading.local()
        self.count = itertools.count()

    def laid_out(self) -> list[Chunk]:
        """This thread's chunks, in the order their records were laid out."""
        if not hasattr(self._laid_out, "chunks"):
            self._laid_out.chunks = []
        return self._laid_out.chunks

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=True) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for index, c in self._chunks.items()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        return SavePlan(items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self._objects[write_item.index.fqn], buffer)
            buffer.seek(0)
            return buffer
        chunk = self._chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        self.laid_out().append(chunk)  # DCP torch.saves it next, leaving its record to fill
        next(self.count)
        return torch.empty(chunk.shape, dtype=chunk.dtype)  # never touched: takes no memory


def _chunk_bytes(chunk: Chunk):
    """The chunk's bytes to place: its source byte ranges, or the chunk built in memory."""
    ranges = chunk.ranges()
    if ranges is not None:
        return ranges
    tensor = chunk.load().contiguous()
    return tensor.reshape(chunk.shape) if tuple(tensor.shape) != chunk.shape else tensor  # a stacked chunk is [1, ...]


def extra_state_objects(num_layers: int, num_experts: int = 0, shared_expert: bool = False,
                        moe_layers: str | None = None,
                        attention: tuple[str, ...] = naming.MOE_ATTENTION_EXTRA_STATE,
                        linear_layers: str | None = None) -> dict[str, object]:
    """The `_extra_state` ShardedObjects megatron-core's GPT layers contribute (value [None]); an
    expert's is keyed by (layer, expert), as ShardedObject.unique_key writes offsets and shape.
    Keyed per layer where `moe_layers` mixes dense layers in (offset 0 of shape 1 then,
    transformer/utils.py _get_extra_state_offsets). `attention`: the attention's linears
    (naming.attention_linears); `linear_layers` as ModelSpec's (its "1" layers have the gated delta net's
    linears instead, and every layer is keyed on its own)."""
    if linear_layers and set(linear_layers) <= set(naming.HYBRID_EXTRA_STATE):  # a hybrid model's pattern
        # and its output layer's: HybridModel (MambaModel before 0.18) keeps it in its sharded state dict, where
        # GPTModel.sharded_state_dict pops it (0.19.2 gpt_model.py:890-897)
        # and its MoE layers' experts, keyed by (expert, experts) as in a GPT model's per-layer keys
        names = [*naming.hybrid_extra_state_names(linear_layers), naming.OUTPUT_LAYER_EXTRA_STATE]
        experts = {f"{naming.layer_name(layer, EXPERTS_PREFIX)}linear_fc{k}._extra_state/shard_{e}_{num_experts}": [None]
                   for layer, symbol in enumerate(linear_layers) if symbol == "E" for k in (1, 2) for e in range(num_experts)}
        return {**{f"{name}/shard_0_1": [None] for name in names}, **experts}
    if moe_layers is not None or linear_layers is not None:
        kinds = moe_layers or ("1" if num_experts else "0") * num_layers
        return _per_layer_extra_state_objects(num_experts, shared_expert, kinds, attention, linear_layers)
    modules = attention if num_experts else attention + naming.MLP_EXTRA_STATE
    modules += naming.SHARED_EXPERT_EXTRA_STATE if shared_expert else ()
    objects = {
        f"{STACKED_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}": [None]
        for module in modules
        for layer in range(num_layers)
    }
    objects.update(
        (f"{STACKED_PREFIX}{EXPERTS_PREFIX}linear_fc{k}._extra_state/shard_{layer}.{e}_{num_layers}.{num_experts}", [None])
        for k in (1, 2)
        for layer in range(num_layers)
        for e in range(num_experts)
    )
    return objects


def _per_layer_extra_state_objects(num_experts: int, shared_expert: bool, moe_layers: str, layer_attention: tuple[str, ...],
                                   linear_layers: str | None) -> dict[str, object]:
    objects = {}
    for layer, kind in enumerate(moe_layers):
        prefix = naming.layer_name(layer, "")
        linear = linear_layers is not None and linear_layers[layer] == "1"
        attention = naming.GDN_EXTRA_STATE if linear else layer_attention
        if kind == "0":
            objects.update((f"{prefix}{m}._extra_state/shard_0_1", [None]) for m in attention + naming.MLP_EXTRA_STATE)
            continue
        shared = naming.SHARED_EXPERT_EXTRA_STATE if shared_expert else ()
        objects.update((f"{prefix}{m}._extra_state/shard_0_1", [None]) for m in attention + shared)
        objects.update((f"{prefix}{EXPERTS_PREFIX}linear_fc{k}._extra_state/shard_{e}_{num_experts}", [None])
                       for k in (1, 2) for e in range(num_experts))
    return objects


class _ReservedRecords:
    """A DCP output stream that notes each record torch.save reserves under skip_data (a seek
    over the record's bytes) as (offset, size). DCP closes the stream it hands torch.save after
    each item, so close only flushes (the file system closes the file)."""

    def __init__(self, stream):
        self.stream, self.records = stream, []

    def close(self) -> None:
        self.stream.flush()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR:
            raise RuntimeError("DCP's stream moved other than over a reserved record")
        self.records.append((self.stream.tell(), offset))
        return self.stream.seek(offset, whence)

    def __getattr__(self, name):  # write, tell, flush, ... of the wrapped stream
        return getattr(self.stream, name)


class _PlainTransforms:
    """DCP's stream transforms without extensions, handing torch.save our stream itself: DCP's
    default wraps it in an io.IOBase whose seek fails, which skip_data needs. No extension is
    recorded, as with DCP's default (the metadata is the same)."""

    def transform_save_stream(self, write_item, raw_stream):
        return raw_stream, []


class _FillingFileSystem(FileSystem):
    """DCP's local file system that, as each data file is closed, fills its reserved records
    with the chunks the planner laid out, in order, and hashes the file (RecordFiller). DCP
    writes each data file on a thread of its own, where torch.save runs under skip_data (a
    per-thread setting), and only prints what such a thread raises: `errors` keeps it."""

    def __init__(self, planner: _LazySavePlanner):
        super().__init__()
        self.planner = planner
        self.digests: dict[Path, str] = {}
        self.errors: list[BaseException] = []

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            first = len(self.planner.laid_out())
            with super().create_stream(path, mode) as stream, torch.serialization.skip_data():
                recorder = _ReservedRecords(stream)
                yield recorder
            chunks = self.planner.laid_out()[first:]
            if len(chunks) != len(recorder.records):
                raise RuntimeError(f"{path}: {len(recorder.records)} records reserved for {len(chunks)} chunks")
            self.digests[Path(path).resolve()] = fill_records(Path(path), self._records(recorder.records, chunks))
        except BaseException as e:
            self.errors.append(e)
            raise

    def _records(self, reserved: list[tuple[int, int]], chunks: list[Chunk]):
        """(offset, size, bytes to place) of each chunk, and the planner's on_item once it is placed."""
        for (offset, size), chunk in zip(reserved, chunks):
            yield offset, size, _chunk_bytes(chunk)
            self.planner.on_item()


@contextmanager
def _quiet_about(errors: list[BaseException]):
    """No traceback printed for a DCP writer thread that died of an error in `errors`, which
    the caller raises as the conversion's one error; any other is printed as usual. When DCP's own
    (main-thread) write fails it returns without joining its other writer threads
    (filesystem.py _write_data): they are joined here, before the usual hook is back."""
    printing = threading.excepthook
    before = set(threading.enumerate())

    def hook(args):
        if args.exc_value not in errors:
            printing(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        for thread in set(threading.enumerate()) - before:
            if thread.name.endswith("(_write_files_from_queue)"):  # Python names a thread after its target
                thread.join()
        threading.excepthook = printing


def write(directory: Path, chunks: list[Chunk], objects: dict[str, object], common: dict,
          on_item=lambda: None) -> dict[Path, str]:
    """Write the checkpoint; returns the checksums of the data files, hashed as they were filled.
    `common` goes where the installed megatron-core's loader looks for it (common.pt, or from 0.19 a
    `common_state` object in the DCP files: toolkit.runtime.megatron_versions)."""
    from toolkit.runtime import megatron_versions

    in_dcp = megatron_versions.common_state_in_dcp()
    if in_dcp:
        objects = {**objects, megatron_versions.COMMON_STATE_KEY: [common]}
    directory.mkdir(parents=True)
    planner = _LazySavePlanner(chunks, objects, on_item)
    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=DATA_FILES, sync_files=False)
    # The writer's file system and stream transforms are attributes of DCP's FileSystemWriter
    # (torch 2.13); a release that renamed them would leave the records unfilled (or fail on the
    # seek), which the check below refuses.
    writer.fs = filling = _FillingFileSystem(planner)
    writer.transforms = _PlainTransforms()
    try:
        with without_zip_crc32(), _quiet_about(filling.errors):  # DCP torch.saves each tensor into the data file
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException:  # DCP's CheckpointException is a BaseException
        if not filling.errors:
            raise
    if filling.errors:  # our own error, not DCP's wrapping of it
        raise filling.errors[0]
    laid_out, data_files = next(planner.count), {p.resolve() for p in directory.glob("*" + DATA_SUFFIX)}
    if laid_out != len(chunks) or not data_files or set(filling.digests) != data_files:
        raise RuntimeError(f"{directory}: {laid_out} of {len(chunks)} chunks laid out, "
                           f"{len(filling.digests)} of {len(data_files)} data files filled")
    if not in_dcp:
        torch.save(common, directory / megatron_versions.COMMON_PT)
    (directory / "metadata.json").write_text(json.dumps(MCORE_METADATA))
    return filling.digests


class IndexedReader(FileSystemReader):
    """A torch_dist directory whose DCP index (.metadata, which names every chunk of every tensor)
    is read once, however many tensors and boxes are read through it: DCP's own reader reads it
    again for every load."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self._index = None

    def read_metadata(self, *args, **kwargs):
        if self._index is None:
            self._index = super().read_metadata(*args, **kwargs)
        return self._index


def _reader(source: Path | IndexedReader) -> IndexedReader:
    return source if isinstance(source, IndexedReader) else IndexedReader(source)


def tensor_shapes(source: Path | IndexedReader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor in a torch_dist checkpoint (a directory, or its reader)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in _reader(source).read_metadata().state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Reads one box (offsets + shape) of one stored tensor into a buffer of that shape."""

    def __init__(self, key: str, offsets: tuple[int, ...]):
        super().__init__()
        self._key, self._offsets = key, offsets

    def create_local_plan(self) -> LoadPlan:
        buffer = self.state_dict[self._key]
        box = ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=buffer.shape)
        stored = self.metadata.state_dict_metadata[self._key]
        return LoadPlan(create_read_items_for_chunk_list(self._key, stored, [box]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the buffer is the box itself, whatever its offset


def read_box(source: Path | IndexedReader, key: str, offsets: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """Part of a stored global tensor, e.g. one layer of a stacked tensor; DCP reads only the
    chunks that overlap it. Reading many boxes, pass one IndexedReader."""
    buffer = torch.empty(shape, dtype=dtype)
    dcp_load({key: buffer}, storage_reader=_reader(source), planner=_SliceLoadPlanner(key, offsets), no_dist=True)
    return buffer
