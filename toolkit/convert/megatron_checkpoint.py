"""Open a megatron-core checkpoint on disk and stream its tensors back as HF tensors.

Reads checkpoints written by this toolkit (with toolkit_checkpoint.json) in either format, and
Megatron-LM's per-rank `torch` and `torch_dist` formats given the HF config of the architecture.
A Megatron-LM torch_dist training checkpoint (dist_checkpointing.save of the model's and its
optimizer's sharded_state_dict) holds the model under megatron-core's own keys, the ones ours
use, beside the optimizer's `optimizer.*` tensors, which an export leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from toolkit.convert import consistency, dist_format, torch_format
from toolkit.convert.hf_config import checked_spec
from toolkit.convert.hf_source import TOKENIZER_FILES, read_config
from toolkit.convert.jsonfile import parse_json_object, read_file_bytes, read_utf8
from toolkit.convert.stages import row_instances
from toolkit.convert.metadata import (
    HF_DIR,
    META_FILE,
    RELEASE,
    TRACKER,
    CheckpointMeta,
    check_file_set,
    verify_file,
)
from toolkit.errors import ConversionError
from toolkit.families import Family, ModelSpec
from toolkit.layouts import Layout
from toolkit.splits.kinds import merge_shards

OPTIMIZER_PREFIX = "optimizer."  # megatron-core's DistributedOptimizer / optimizer keys in torch_dist
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _training_model_dir(root: Path) -> Path:
    """Fine-tuning checkpoints keep an exportable model in `model/`: accept a run directory, its
    checkpoints/ directory or one step directory as well."""
    for candidate in (root / "checkpoints", root):
        latest = candidate / "latest"
        if latest.is_file():
            root = candidate / read_utf8(latest).strip()
            break
    return root / "model" if (root / "model" / META_FILE).is_file() else root


def resolve_iteration_dir(root: Path) -> Path:
    """The directory holding the shards: `release/` or `iter_NNNNNNN/` per the tracker file."""
    tracker = root / TRACKER
    if not tracker.is_file():
        if any(root.glob("mp_rank_*")) or (root / "metadata.json").is_file():
            return root
        raise ConversionError(f"{root} has no {TRACKER}: not a Megatron checkpoint directory")
    value = read_utf8(tracker).strip()
    if value == RELEASE:
        return root / RELEASE
    if not value.isdigit():
        raise ConversionError(f"{tracker} holds {value!r}, expected 'release' or an iteration number")
    return root / f"iter_{int(value):07d}"


@dataclass
class MegatronCheckpoint:
    root: Path
    shards: Path  # release/ or iter_*/
    fmt: str
    family: Family
    spec: ModelSpec
    layout: Layout
    config_bytes: bytes
    tokenizer_files: list[Path]
    meta: CheckpointMeta | None
    verified: set = field(default_factory=set, repr=False, compare=False)  # files whose checksum was checked
    # torch_dist: DCP's index of the shards, read once for every tensor (toolkit.convert.dist_format)
    dist_reader: dist_format.IndexedReader | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, root: str | Path, hf_config: str | Path | None = None) -> "MegatronCheckpoint":
        root = _training_model_dir(Path(root))
        if not root.is_dir():
            raise ConversionError(f"{root} is not a directory")
        shards = resolve_iteration_dir(root)
        if (root / META_FILE).exists():
            return cls._ours(root, shards)
        return cls._megatron_lm(root, shards, hf_config)

    @classmethod
    def _ours(cls, root: Path, shards: Path) -> "MegatronCheckpoint":
        """Metadata checked against the HF config and the file set before any shard is read; each
        shard's checksum is checked when it is read (see _verified)."""
        meta = CheckpointMeta.read(root)
        spec = meta.model_spec
        config_path = root / HF_DIR / "config.json"
        config_bytes = read_file_bytes(config_path)  # read once: checked here, copied as they are by an export
        family, config_spec = checked_spec(parse_json_object(config_bytes, config_path), config_path)
        consistency.check_spec_matches_config(spec, config_spec, root / META_FILE, config_path)
        if meta.vocab_size != spec.vocab_size:
            raise ConversionError(f"{root / META_FILE} says vocab_size={meta.vocab_size} but its spec says "
                                  f"{spec.vocab_size}: {consistency.EDITED_HINT}")
        check_file_set(root, shards, meta.checksums)
        consistency.check_format_files(meta.format, shards)
        if meta.format == "torch":
            found = torch_format.discover_layout(shards, second_is_expert=meta.pp == 1 and meta.ep > 1)
            consistency.check_rank_layout(found, meta.layout, shards)
        meta.layout.check(spec)
        tokenizer = sorted(p for p in (root / HF_DIR).iterdir() if p.name != "config.json" and p.is_file())
        return cls(root, shards, meta.format, family, spec, meta.layout, config_bytes, tokenizer, meta)

    @classmethod
    def _megatron_lm(cls, root: Path, shards: Path, hf_config: str | Path | None) -> "MegatronCheckpoint":
        if hf_config is None:
            raise ConversionError(
                f"{root} was not written by this toolkit: pass --hf-config (an HF config.json or model "
                "directory) describing its architecture"
            )
        hf_config = Path(hf_config)
        if not hf_config.exists():
            raise ConversionError(f"--hf-config {hf_config} does not exist")
        config_dir = hf_config if hf_config.is_dir() else hf_config.parent
        config_path = config_dir / "config.json" if hf_config.is_dir() else hf_config
        if config_path.is_file():
            config_bytes = read_file_bytes(config_path)
            cfg = parse_json_object(config_bytes, config_path)
        else:
            cfg = read_config(config_dir)
            config_bytes = config_path.read_bytes()
        family, spec = checked_spec(cfg, config_path)
        tokenizer = [config_dir / n for n in TOKENIZER_FILES if (config_dir / n).is_file()] if hf_config.is_dir() else []
        if (shards / "metadata.json").is_file():  # torch_dist: global tensors, written at any layout
            reader = dist_format.IndexedReader(shards)
            layout = Layout(1, 1, _stored_vocab_rows(reader, shards))  # the padded vocabulary as stored
            return cls(root, shards, "torch_dist", family, spec, layout, config_bytes, tokenizer, None, dist_reader=reader)
        args = torch_format.stored_args(shards)
        tp, pp, ep = torch_format.discover_layout(shards, second_is_expert=_expert_parallel_at_pp1(args))
        # Megatron-LM pads the vocab to a multiple of make_vocab_size_divisible_by x TP (arguments.py)
        divisor = getattr(args, "make_vocab_size_divisible_by", None) or 1
        return cls(root, shards, "torch", family, spec, Layout(tp, pp, divisor, ep), config_bytes, tokenizer, None)

    def hf_tensors(self, wanted: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor of the HF model (or only `wanted` ones), one at a time."""
        if self.fmt == "torch":
            yield from self._from_rank_files(wanted)
        else:
            yield from self._from_dist(wanted)

    def _verified(self, path: Path) -> None:
        """Checksums are checked as each file is first read (its one sequential read also warms the
        page cache the memory-mapped load then uses); Megatron-LM checkpoints have none to check."""
        if self.meta is not None and path not in self.verified:
            verify_file(self.root, path, self.meta.checksums)
            self.verified.add(path)

    def _rows(self):
        return self.family.rows_for(self.spec)

    def _from_rank_files(self, wanted):
        """Stage by stage, EP rank by EP rank: memory maps one EP rank's TP files at a time. The dense
        tensors come from EP rank 0's files (every EP rank's files hold the same)."""
        for pp_rank in range(self.layout.pp):
            for ep_rank in range(self.layout.ep):
                yield from self._from_stage(pp_rank, ep_rank, wanted)

    def stage(self, pp_rank: int, ep_rank: int = 0) -> list[dict[str, torch.Tensor]]:
        """Each TP rank's tensors of one stored stage (and EP rank) of a per-rank checkpoint, in
        canonical names, memory-mapped; checksums and shapes checked."""
        stage = torch_format.read_stage(self.shards, self.layout, pp_rank, self._verified, ep_rank)
        consistency.check_stage(stage, self.family, self.spec, self.layout, pp_rank, self.shards)
        return stage

    def _from_stage(self, pp_rank: int, ep_rank: int, wanted):
        geo = self.layout.geometry(self.spec)
        layers, experts = self.layout.stage_layers(self.spec, pp_rank), self.layout.local_experts(self.spec, ep_rank)
        rows = [r for r in self._rows() if r.per_expert or ep_rank == 0]
        if wanted is not None and not any(_needed(r, layers, experts, wanted, self.spec.moe_layers, self.spec.linear_layers) for r in rows):
            return
        stage = self.stage(pp_rank, ep_rank)
        for row in rows:
            for layer, local, expert, local_expert in row_instances(row, layers, experts, self.spec.moe_layers, self.spec.linear_layers):
                names = row.hf_names(layer, expert)
                if wanted is not None and not wanted.intersection(names):
                    continue
                name = row.megatron_name(local, local_expert)
                if name not in stage[0]:
                    continue  # embedding / final norm / output layer live on one stage only
                yield from zip(names, merge_shards(row.split, [rank_state[name] for rank_state in stage], geo))

    def _from_dist(self, wanted):
        geo = self.layout.geometry(self.spec)
        for path in sorted(p for p in self.shards.rglob("*") if p.is_file()):
            self._verified(path)  # DCP reads pieces of every file: check them all first
        if self.dist_reader is None:
            self.dist_reader = dist_format.IndexedReader(self.shards)
        stored = _model_tensors(dist_format.tensor_shapes(self.dist_reader))
        consistency.check_dist(stored, self.family, self.spec, self.layout, self.shards)
        every_layer, every_expert = range(self.spec.num_layers), range(self.spec.num_experts)
        stacked = dist_format.stacks_layers(self.spec.moe_layers, self.spec.linear_layers)
        for row in self._rows():
            for layer, _, expert, _ in row_instances(row, every_layer, every_expert, self.spec.moe_layers, self.spec.linear_layers):
                names = row.hf_names(layer, expert)
                if wanted is not None and not wanted.intersection(names):
                    continue
                yield from zip(names, merge_shards(row.split, [self._dist_tensor(row, layer, expert, stacked, stored)], geo))

    def _dist_tensor(self, row, layer, expert, stacked: bool, stored: dict) -> torch.Tensor:
        """The TP=1 megatron tensor of one row instance, from its torch_dist key (or keys: dist_parts)."""
        key = dist_format.row_key(row, layer, stacked)
        parts = []
        for suffix in dist_format.dist_suffixes(row.split):
            if key + suffix not in stored:
                raise ConversionError(f"{self.shards} has no tensor {key + suffix!r}")
            shape, dtype = stored[key + suffix]
            # the stacked (layer, expert) dims
            index = [i for i in (layer if stacked else None, expert) if i is not None]
            box = dist_format.read_box(self.dist_reader, key + suffix, (*index, *(0,) * (len(shape) - len(index))),
                                       (*(1,) * len(index), *shape[len(index):]), dtype)
            parts.append(box.reshape(shape[len(index):]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _model_tensors(stored: dict) -> dict:
    return {k: v for k, v in stored.items() if not k.startswith(OPTIMIZER_PREFIX)}


def _stored_vocab_rows(reader: dist_format.IndexedReader, shards: Path) -> int:
    stored = dist_format.tensor_shapes(reader)
    for key in VOCAB_KEYS:
        if key in stored:
            return stored[key][0][0]
    raise ConversionError(f"{shards} holds neither {VOCAB_KEYS[0]!r} nor {VOCAB_KEYS[1]!r}: not a GPT model checkpoint")


def _needed(row, layers, experts, wanted: set[str], moe_layers: str | None, linear_layers: str | None = None) -> bool:
    return any(wanted.intersection(row.hf_names(layer, expert))
               for layer, _, expert, _ in row_instances(row, layers, experts, moe_layers, linear_layers))


def _expert_parallel_at_pp1(args) -> bool:
    """Whether a Megatron-LM checkpoint's mp_rank_TT_NNN names an EP rank: its stored args say."""
    return getattr(args, "pipeline_model_parallel_size", 1) == 1 and getattr(args, "expert_model_parallel_size", 1) > 1
