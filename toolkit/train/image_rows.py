"""The recipe's data for a vision-language checkpoint: records with images encoded by the model's own processor
(toolkit.train.vlm_data), records without by the text path (toolkit.train.data), each a row that carries its
images; a micro-batch's rows collated with their pixel values and patch grids in batch order, as transformers'
processor batches them (the first row's images first).

Read in memory (data.prepared is not read: the prepared store holds tokens, not pixels); one sample per row
(data.pack is refused for images: toolkit.train.build.check_vision_language).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.train import data, data_sources
from toolkit.train.data import BatchSource, Row
from toolkit.train.vlm_data import IGNORE_INDEX, VLMSample, VLMStats, encode_vlm_conversation, load_processor

TOKEN_TYPES = "mm_token_type_ids"  # the processor's per-token kinds (0 text, 1 image), which MRoPE's positions read


@dataclass
class ImageRow(Row):
    """A row (seq_len + 1 tokens) with its sample's images: none for a text sample."""

    token_types: list[int] | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def reader(tokenizer, wrapper: Path, opts: data.ReadOptions, cache: Path):
    """read(source, stats) -> the source's samples: a VLMSample for a record with images, by the processor of
    `wrapper` (loaded at the first image: text alone needs none), a text Sample else."""
    processor = functools.cache(lambda: load_processor(wrapper))

    def read(source, stats: data.DataStats):
        base_dir = Path(source.name).parent  # images are paths relative to the data file's directory
        encoded, samples = VLMStats(), []
        for where, record in data_sources.records(source, opts.columns, cache):
            if data.image_in(record) is None:
                samples += data.read_samples([(where, record)], tokenizer, opts, stats)
                continue
            stats.lines += 1
            sample = encode_vlm_conversation(processor(), record, base_dir, opts.max_tokens - 1, where, encoded)
            if sample is not None:
                stats.tokens += len(sample.input_ids)
                samples.append(sample)
        for name in ("samples", "truncated", "dropped_targets_truncated", "dropped_no_targets"):
            setattr(stats, name, getattr(stats, name) + getattr(encoded, name))
        stats.dropped_overlong += encoded.dropped_image_truncated  # never half an image: dropped whole
        return samples
    return read


def to_rows(samples: list, length: int, pad_id: int) -> list[ImageRow]:
    """One sample a row, padded to `length` (seq_len + 1) tokens."""
    return [_row(s, length, pad_id) for s in samples]


def _row(sample, length: int, pad_id: int) -> ImageRow:
    if not isinstance(sample, VLMSample):  # a text sample: no images, every token text
        row = data.padded_row(sample, length, pad_id)
        return ImageRow(row.tokens, row.loss_mask, row.doc_ids, [0] * length)
    mask = [int(label != IGNORE_INDEX) for label in sample.labels]
    row = data.padded_row(data.Sample(sample.input_ids, mask), length, pad_id)
    types = sample.per_token[TOKEN_TYPES]
    return ImageRow(row.tokens, row.loss_mask, row.doc_ids, types + [0] * (length - len(types)),
                    torch.as_tensor(sample.pixel_values), torch.as_tensor(sample.image_grid_thw))


def collate(rows: list[ImageRow]) -> dict[str, torch.Tensor]:
    """The text path's batch with `token_types` and, where any row has images, their `pixel_values` and
    `image_grid_thw` in row order."""
    batch = data.collate(rows, packed=False)
    batch["token_types"] = torch.tensor([r.token_types for r in rows], dtype=torch.long)[:, :-1]
    with_images = [r for r in rows if r.pixel_values is not None]
    if with_images:
        batch["pixel_values"] = torch.cat([r.pixel_values for r in with_images])
        batch["image_grid_thw"] = torch.cat([r.image_grid_thw for r in with_images])
    return batch


class ImageBatchSource(BatchSource):
    """BatchSource over ImageRows: the same order and DP shares, the micro-batches collated with their images."""

    def _collate(self, rows: list[ImageRow]) -> dict[str, torch.Tensor]:
        return collate(rows)
