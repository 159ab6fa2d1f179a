"""HF checkpoint -> megatron-core TP x PP (x EP) checkpoint (`torch` per-rank or `torch_dist`).

One process, plain tensor operations: each output file is assembled from slices read straight
from the HF safetensors and written as soon as it is complete.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch


from toolkit.atomic import atomic_directory, refuse_output_overlapping_inputs
from toolkit.convert import ignored, naming, torch_format
from toolkit.convert.consistency import expected_hf_tensors
from toolkit.convert.hf_source import HFCheckpoint, check_weight_dtypes, config_dtype, stored_dtype, weights_dtype
from toolkit.convert.wrapper import open_hf
from toolkit.convert.metadata import (
    CHECKPOINT_VERSION,
    FORMATS,
    HF_DIR,
    RELEASE,
    TRACKER,
    CheckpointMeta,
    checksum_tree,
    copy_hf_files,
)
from toolkit.convert.progress import progress_bar
from toolkit.convert.range_copy import shard_or_ranges, shard_ranges
from toolkit.convert.spec_guess import GuessWrong, SpecGuess
from toolkit.convert.stages import row_instances, stage_megatron_shapes, stage_tensors
from toolkit.convert.tokenizer_check import warn_if_no_tokenizer
from toolkit.errors import ConversionError
from toolkit.families import Family, ModelSpec
from toolkit.layouts import DEFAULT_VOCAB_DIVISOR, Layout
from toolkit.megatron_settings import megatron_args
from toolkit.splits.kinds import build_shard, megatron_shape

# Rank files written at once, each with its own hashing thread (HFCheckpoint reads are thread-safe:
# each opens its file); two, as the machine has 2 cores.
FILE_THREADS = 2

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint costs ~0.7 s of start-up the torch format skips
    from toolkit.convert import dist_format


def check_tensors(src: HFCheckpoint, family: Family, spec: ModelSpec) -> None:
    """Refuse missing, extra or misshapen tensors before anything is written."""
    expected = expected_hf_tensors(family, spec)
    missing = sorted(set(expected) - set(src.tensors))
    extra = sorted(set(src.tensors) - set(expected))  # what HF ignores on load is out already (src.ignored)
    if missing:
        raise ConversionError(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[0]!r}")
    if extra:
        raise ConversionError(f"{len(extra)} unexpected tensor(s) for {family.name}, e.g. {extra[0]!r}")
    for name, shape in expected.items():
        if src.shape(name) != shape:
            raise ConversionError(
                f"tensor {name!r} has shape {list(src.shape(name))} but config.json implies {list(shape)}"
            )


def output_bytes(src: HFCheckpoint) -> int:
    """About what the converted checkpoint takes on disk: the weights plus the copied HF files."""
    copied = [src.dir / "config.json", *src.tokenizer_files()]
    return sum(e.nbytes for e in src.tensors.values()) + sum(f.stat().st_size for f in copied)


def _write_torch(release: Path, src, family, spec, layout, layer_spec, args, placed) -> dict[Path, str]:
    def build_stage(tp_rank: int, pp_rank: int, ep_rank: int):
        return stage_tensors(src, family, spec, layout, tp_rank, pp_rank, placed, ep_rank,
                             build=shard_or_ranges)

    def stage_shapes(pp_rank: int):
        return stage_megatron_shapes(family, spec, layout, pp_rank)

    local_experts = len(layout.local_experts(spec, 0))
    dtype = weights_dtype(src.tensors, family.hf_float32)  # one dtype (check_weight_dtypes), never cast
    return torch_format.write_rank_files(release, layout, build_stage, stage_shapes, len(layout.stage_layers(spec, 0)),
                                         layer_spec, args, local_experts, dtype=dtype,
                                         suffix_dtypes=float32_as_stored(src, family), file_threads=FILE_THREADS)


def float32_as_stored(src, family: Family) -> dict[str, torch.dtype]:
    """megatron-core name suffix -> the dtype the HF checkpoint stores it in, of each tensor transformers
    keeps in float32 (Row.kept_in_float32): the router weight (float32 from transformers 5.24, the weights'
    dtype before), the expert bias (float32, as megatron-core keeps it: router.py _maintain_float32_expert_bias)."""
    stored = {ours: stored_dtype(src.tensors, hf) for ours, hf in family.float32_names}
    return {suffix: dtype for suffix, dtype in stored.items() if dtype is not None}


def dist_chunks(src, family: Family, spec: ModelSpec, layout: Layout) -> list[dist_format.Chunk]:
    """One chunk per global tensor, per layer of a stacked one, per (layer, expert) of an expert's."""
    from toolkit.convert import dist_format

    geo = layout.geometry(spec)
    stacked = dist_format.stacks_layers(spec.moe_layers, spec.linear_layers)
    chunks = []
    for row in family.rows_for(spec):
        for layer, _, expert, _ in row_instances(row, range(spec.num_layers), range(spec.num_experts), spec.moe_layers, spec.linear_layers):
            names = row.hf_names(layer, expert)
            shape = megatron_shape(row.split, [src.shape(n) for n in names], geo)
            dtype = src.tensors[names[0]].torch_dtype
            load = lambda split=row.split, names=names: build_shard(split, src, names, 1, 0, geo)  # noqa: E731
            ranges = lambda split=row.split, names=names: shard_ranges(split, src, names, 1, 0, geo)  # noqa: E731
            stack = [(spec.num_layers, layer)] * (row.per_layer and stacked) + [(spec.num_experts, expert)] * row.per_expert
            key = dist_format.row_key(row, layer, stacked)
            for suffix, start, rows in dist_format.dist_parts(row.split, shape, geo):
                part = (rows, *shape[1:])
                # one part of the tensor: built whole, then cut (its byte ranges not described)
                part_load = load if rows == shape[0] else (
                    lambda whole=load, s=slice(start, start + rows): whole()[s].clone())  # noqa: E731
                chunks.append(dist_format.Chunk(key + suffix, (*(n for n, _ in stack), *part),
                                                (*(i for _, i in stack), *(0,) * len(part)), (1,) * len(stack) + part,
                                                dtype, part_load, ranges if rows == shape[0] else (lambda: None)))
    return dist_format.with_te_moe_aliases(chunks, spec.moe_layers) if spec.is_moe else chunks


def torch_tensor_count(family: Family, spec: ModelSpec, layout: Layout) -> int:
    """Tensors the per-rank writer builds (for the progress bar)."""
    experts = layout.local_experts(spec, 0)
    per_rank = sum(1 for r in family.rows_for(spec)
                   for _ in row_instances(r, range(spec.num_layers), experts, spec.moe_layers, spec.linear_layers))
    tied_output_copy = spec.tied_embeddings and layout.pp > 1  # the last stage's output layer
    return layout.tp * layout.ep * (per_rank + tied_output_copy)


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    fmt: str = "torch",
    layer_spec: str | None = None,
    vocab_divisor: int = DEFAULT_VOCAB_DIVISOR,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Convert an HF checkpoint directory into a megatron-core checkpoint at `out_dir` (of a
    multimodal checkpoint, its language model: toolkit/convert/wrapper.py).

    `layer_spec` None: the one the model needs where it converts for one only (ModelSpec.required_layer_spec,
    said in a line on stderr), else the TE spec's names; one the model cannot take is refused.

    Everything is validated before the first byte is written, but for transformers' own reading of
    config.json where a guess of it lets the writing start earlier (toolkit/convert/spec_guess.py):
    its refusal still stops the conversion. The result appears at `out_dir` only once complete
    (see toolkit.atomic).
    """
    if fmt not in FORMATS:
        raise ConversionError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if layer_spec is not None and layer_spec not in naming.LAYER_SPECS:
        raise ConversionError(f"unknown layer spec {layer_spec!r} (choose from {', '.join(naming.LAYER_SPECS)})")
    refuse_output_overlapping_inputs(out_dir, hf_dir)
    src = open_hf(hf_dir)  # a multimodal checkpoint as its language model (toolkit/convert/wrapper.py)
    target = _Target(Path(out_dir), tp, pp, ep, fmt, layer_spec, vocab_divisor, overwrite, progress)
    with SpecGuess(src.config, src.dir / "config.json", src.tensors) as reading:
        family, spec = reading.guess or reading.confirmed()
        _notes(src, family, spec)
        try:
            return _convert(src, family, spec, _with_layer_spec(target, family, spec, say=True), check=reading.check)
        except (GuessWrong, ConversionError) as e:
            if reading.guess is None:
                raise
            confirmed = reading.confirmed()  # raises transformers' refusal of config.json, which comes first
            if isinstance(e, ConversionError) and confirmed == reading.guess:
                raise
        return _convert(src, *confirmed, _with_layer_spec(target, *confirmed, say=False),  # again, on the class's values
                        check=_confirmed_already)


def _with_layer_spec(target: _Target, family: Family, spec: ModelSpec, say: bool) -> _Target:
    """`target` with the layer spec it writes: the one asked for, or by default the one the model needs
    (said on stderr where `say`), else the TE spec's names."""
    required = spec.required_layer_spec
    if target.layer_spec is None:
        if required and say:
            print(f"note: {family.name}: layer spec {required[0]} ({required[1]})", file=sys.stderr)
        return replace(target, layer_spec=required[0] if required else naming.DEFAULT_LAYER_SPEC)
    if required and target.layer_spec != required[0]:
        raise ConversionError(f"{family.name}: --layer-spec {target.layer_spec} refused: {required[1]} (leave "
                              f"--layer-spec out, or pass {required[0]}; the TE spec's layout is not written yet)")
    return target


def _confirmed_already(wait: bool = False) -> None:
    """The check of a spec transformers' config class has read: nothing to check."""


@dataclass(frozen=True)
class _Target:
    """What hf_to_megatron was asked to write."""

    out_dir: Path
    tp: int
    pp: int
    ep: int
    fmt: str
    layer_spec: str | None  # None: the model's own (_with_layer_spec)
    vocab_divisor: int
    overwrite: bool
    progress: bool | None


def _notes(src, family: Family, spec: ModelSpec) -> None:
    """What the conversion leaves out or changes, said once before the writing starts."""
    if getattr(src, "dequantized", None):
        print(f"note: the experts' MXFP4 weights ({len(src.dequantized)} tensors, e.g. {src.dequantized[0]!r} with its "
              "_scales) are dequantized to bfloat16 on import (exactly: each is an FP4 value times a power of two); "
              "the converted checkpoint and its export are bf16, their config.json without quantization_config",
              file=sys.stderr)
    for kind, names in src.ignored.items():
        print(f"note: {ignored.note(kind, names, src.config, family)}", file=sys.stderr)


def _placed(bar, check) -> Callable[[], None]:
    """Called as each record is placed: the progress bar, then the spec's check (SpecGuess.check)."""
    def placed() -> None:
        bar.update(1)
        check()
    return placed


def _convert(src, family: Family, spec: ModelSpec, target: _Target, check) -> Path:
    """Validate and write, given the spec; `check()` is called as records are placed and
    `check(wait=True)` before the metadata (SpecGuess.check: it raises where the spec was a wrong guess)."""
    layout = Layout(target.tp, target.pp, target.vocab_divisor, target.ep)
    layout.check(spec)
    check_tensors(src, family, spec)
    check_weight_dtypes(src.tensors, config_dtype(src.config), family.hf_float32)
    args = megatron_args(spec, layout, target.fmt)
    with atomic_directory(target.out_dir, target.overwrite, needed_bytes=output_bytes(src)) as tmp:
        release = tmp / RELEASE
        if target.fmt == "torch":
            with progress_bar(torch_tensor_count(family, spec, layout), "writing shards", target.progress) as bar:
                written = _write_torch(release, src, family, spec, layout, target.layer_spec, args, _placed(bar, check))
            checksums = {str(p.relative_to(tmp)): digest for p, digest in written.items()}
        else:
            from toolkit.convert import dist_format

            chunks = dist_chunks(src, family, spec, layout)
            common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
            with progress_bar(len(chunks), "writing torch_dist", target.progress) as bar:
                objects = dist_format.extra_state_objects(
                    spec.num_layers, spec.num_experts, spec.moe_shared_ffn_hidden_size > 0, spec.moe_layers,
                    naming.attention_linears(r.megatron_name(0) for r in family.rows_for(spec) if r.per_layer),
                    spec.linear_layers)
                hashed = dist_format.write(release, chunks, objects, common, _placed(bar, check))
            checksums = checksum_tree(tmp, known=hashed)
        check(wait=True)
        (tmp / TRACKER).write_text(RELEASE)
        copy_hf_files(src.config_bytes, src.tokenizer_files(), tmp / HF_DIR)
        CheckpointMeta(
            format=target.fmt,
            layer_spec=target.layer_spec,
            tp=target.tp,
            pp=target.pp,
            ep=target.ep,
            vocab_divisor=target.vocab_divisor,
            vocab_size=spec.vocab_size,
            padded_vocab_size=layout.padded_vocab(spec.vocab_size),
            spec=spec.to_dict(),
            checksums=checksums,
            hf_source=str(Path(src.dir).resolve()),
            ignored={kind: len(names) for kind, names in src.ignored.items()},
        ).write(tmp)
    warn_if_no_tokenizer(src.dir, target.out_dir)
    return target.out_dir
