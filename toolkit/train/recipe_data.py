"""The recipe's data, read and checked before the model is built: the checkpoint's tokenizer, every
source read (its prepared store, toolkit.train.prepare_data, or tokenized in memory) and mixed, and
the rows with the start's refusals. recipes/finetune.py reads its data here at every start, and
`toolkit data prepare` (`prepare_for_recipe`) ahead of the job, the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.convert.metadata import HF_DIR
from toolkit.errors import ConfigError, ToolkitError
from toolkit.train.config import TrainConfig, load_config
from toolkit.train.data import Row


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(cfg: TrainConfig):
    """The tokenizer copied into the checkpoint at conversion; one clear line when it is missing."""
    from transformers import AutoTokenizer

    hf_dir = Path(cfg.model.checkpoint) / HF_DIR
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"checkpoint {cfg.model.checkpoint} has no tokenizer ({hf_dir} holds none of {', '.join(TOKENIZER_FILES)}): "
            f"copy the HF model's tokenizer files into {hf_dir}/ (or convert from a directory that has them)"
        )
    try:
        return AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer in {hf_dir} cannot be loaded: {str(e).splitlines()[0]}") from None


@dataclass
class DataRows:
    """The training (and validation) rows, read and checked before the model is built: lists, or
    views over memory-mapped prepared data (toolkit.train.row_views) that make a row when indexed."""

    train: list[Row]
    valid: list[Row] | None
    stats: object  # toolkit.train.data.DataStats of the training data
    images: bool = False  # rows of toolkit.train.image_rows (a vision-language checkpoint's), carrying their images


def read_data(cfg: TrainConfig, tokenizer, wrapper: Path | None = None) -> DataRows:
    """Every rank reads the same data and reaches the same verdict: data that cannot train is one
    DataError here, before any process group. With data.prepared (the default) each source is
    tokenized once, by one process, into a cache every rank maps (toolkit.train.prepare_data); the
    refusals are decided from the counts it stored, at every start. With a vision-language checkpoint's
    `wrapper` (its published checkpoint), records with images are its processor's (toolkit.train.image_rows), read
    in memory."""
    from toolkit.train import chat_templates, data, data_sources, image_rows, preference

    d = cfg.data
    chat_templates.apply(tokenizer, d.chat_template)
    if d.chat_template is not None:
        chat_templates.check(tokenizer)
    opts = data.ReadOptions(d.seq_len + 1, d.overlong, d.malformed, d.truncation, dict(vars(d.columns)))
    cache = Path(d.cache_dir or Path(cfg.run_dir) / "data_cache")
    dpo = cfg.method == "dpo"  # preference pairs (toolkit.train.preference), two rows each
    prepared = d.prepared and wrapper is None
    read_source = image_rows.reader(tokenizer, wrapper, opts, cache) if wrapper is not None else \
        _prepared_reader(cfg, tokenizer, opts, cache) if prepared else _memory_reader(cfg, tokenizer, opts, cache)

    def read(source, stats):
        samples = read_source(source, stats)
        data.refuse_unreadable(source.name, stats, d.max_unk_share, tokenizer)
        data.refuse_empty(source.name, samples, stats)
        return samples

    def to_rows(samples, stats):
        if wrapper is not None:
            return image_rows.to_rows(samples, d.seq_len + 1, data.pad_token(tokenizer))
        if prepared:
            from toolkit.train.row_views import row_view

            rows = row_view(samples, d.seq_len + 1, data.pad_token(tokenizer), cfg.method, d.pack)
            stats.packed_rows = len(rows) if d.pack and not dpo else 0
            return rows
        if dpo:
            return preference.to_pair_rows(samples, tokenizer, d.seq_len)
        return data.to_rows(samples, tokenizer, d.seq_len, d.pack, stats)

    stats = data.DataStats()
    train_sources = data_sources.sources(d.train_file, d.weights, d.split)
    parts = [(s, read(s, stats)) for s in train_sources]
    samples = mixed(parts, cfg.seed, stats) if prepared else data.mix(parts, cfg.seed, stats)
    train = to_rows(samples, stats)
    if len(train) < cfg.global_batch:
        unit = "pairs" if dpo else "packed rows" if d.pack else "samples"
        raise data.DataError(
            f"{d.train_file} gives {len(train)} {unit}, fewer than one global batch "
            f"of {cfg.global_batch}: every step would repeat samples; add data or lower global_batch")
    valid = None
    if d.valid_file or d.valid_split:
        source = data_sources.Source(d.valid_file, "train") if d.valid_file else data_sources.Source(train_sources[0].name, d.valid_split)
        valid = to_rows(read(source, data.DataStats()), data.DataStats())
    return DataRows(train, valid, stats, images=wrapper is not None)


def _memory_reader(cfg: TrainConfig, tokenizer, opts, cache: Path):
    """data.prepared=false: every source tokenized in this process, into lists."""
    from toolkit.train import data, data_sources, preference

    read_records = preference.read_pairs if cfg.method == "dpo" else data.read_samples

    def read(source, stats):
        return read_records(data_sources.records(source, opts.columns, cache), tokenizer, opts, stats)

    return read


def _prepared_reader(cfg: TrainConfig, tokenizer, opts, cache: Path):
    """data.prepared: each source's prepared store (made now if missing), its stored counts added to `stats`."""
    import functools
    import os

    from toolkit.train.prepare_data import PrepareSettings, prepared_source
    from toolkit.train.prepared_key import tokenizer_fingerprint
    from toolkit.train.row_views import PairItems
    from toolkit.train.tokenize_pool import available_cores

    say = functools.partial(print, flush=True) if os.environ.get("RANK", "0") == "0" else (lambda _: None)
    settings = PrepareSettings(cache, cfg.data.num_proc or available_cores(), cfg.data.verify_prepared, say)
    digest = tokenizer_fingerprint(tokenizer)

    def read(source, stats):
        store = prepared_source(source, tokenizer, digest, opts, cfg.method, settings)
        stats.add(store.stats())
        return PairItems(store) if cfg.method == "dpo" else store

    return read


def mixed(parts, seed: int, stats):
    """The prepared sources mixed as toolkit.train.data.mix mixes lists."""
    from toolkit.train.data import mixture_picks
    from toolkit.train.row_views import MixedItems

    if len(parts) == 1:
        return parts[0][1]
    picks = mixture_picks([(src, len(items)) for src, items in parts], seed, stats)
    return MixedItems([items for _, items in parts], picks)


def prepare_for_recipe(config: str | None, overrides: list[str]):
    """`toolkit data prepare`: the recipe's data prepared and checked as its start would (the same
    cache directories, the same refusals), ahead of the job; returns (the config, its DataRows)."""
    cfg = load_config(config, overrides)
    if not cfg.data.prepared:
        raise ToolkitError("data.prepared=false: the recipe tokenizes in memory at every start, there is nothing to "
                           "prepare (leave data.prepared at its default, true)")
    _refuse_vision_language(cfg)
    return cfg, read_data(cfg, load_tokenizer(cfg))


def _refuse_vision_language(cfg: TrainConfig) -> None:
    from toolkit.convert.metadata import META_FILE, CheckpointMeta
    from toolkit.vlm.vision_tower import TOWERS

    checkpoint = Path(cfg.model.checkpoint)  # a missing one is load_tokenizer's to refuse
    family = CheckpointMeta.read(checkpoint).model_spec.family if (checkpoint / META_FILE).is_file() else None
    if family in TOWERS:
        raise ToolkitError(f"{cfg.model.checkpoint} is a vision-language model ({family}): the recipe reads its data, "
                           "images included, in memory at every start; there is nothing to prepare")
