"""Instruction data: records -> token sequences with a loss mask -> deterministic DP-sharded batches.

Record formats (columns renamed to these by data.columns; sources: toolkit.train.data_sources):
  {"prompt": ..., "response": ...}   prompt tokens are masked out of the loss
  {"messages": [{"role", "content"}]} rendered with the chat template (toolkit.train.chat_templates);
                                      only assistant turns count in the loss
  {"text": ...}                       every token counts
EOS is appended after each response/text. Tokenizers without a pad token (Llama 3) pad with EOS;
padded positions never count in the loss, and causal attention keeps them from affecting real ones.

Data that cannot train is refused before the model is built, in one line: a tokenizer that reads
it as mostly `<unk>`, a result with no sample left (with the count dropped for each reason), fewer
rows than one global batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.train import chat_prefixes, chat_templates
from toolkit.train.chat_templates import ChatTemplateError
from toolkit.train.data_sources import OUR_COLUMNS, DataError, Source, records

IDENTITY_COLUMNS = {c: c for c in OUR_COLUMNS}
EXAMPLE_CHARS = 80  # of the record quoted in a refusal


@dataclass
class Sample:
    tokens: list[int]
    loss_mask: list[int]  # 1 where tokens[i] is a target to predict


@dataclass
class DataStats:
    """Counts written to the resolved config and the log: every sample read and why any was dropped."""

    lines: int = 0
    skipped_malformed: int = 0  # data.malformed=skip
    truncated: int = 0  # longer than seq_len + 1 tokens, cut at data.truncation's side
    dropped_overlong: int = 0  # data.overlong=drop
    dropped_targets_truncated: int = 0  # truncation cut every token the sample trains on
    dropped_no_targets: int = 0  # nothing to train on even uncut (e.g. no assistant turn)
    samples: int = 0
    tokens: int = 0
    unk_tokens: int = 0
    unk_example: str | None = field(default=None, repr=False)
    packed_rows: int = 0
    mixture: dict = field(default_factory=dict)  # source -> samples taken, with data.weights

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "unk_example"}

    def add(self, other: "DataStats") -> None:
        """Count `other` (read after these) in: its counts added, the first `<unk>` example kept."""
        for name, value in other.__dict__.items():
            if isinstance(value, int):
                setattr(self, name, getattr(self, name) + value)
        if self.unk_example is None:
            self.unk_example = other.unk_example
        self.mixture.update(other.mixture)


@dataclass(frozen=True)
class ReadOptions:
    max_tokens: int  # seq_len + 1
    overlong: str = "truncate"
    malformed: str = "error"
    truncation: str = "right"  # keep the first tokens ("right": cut the end) or the last ("left")
    columns: dict = field(default_factory=lambda: dict(IDENTITY_COLUMNS))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_response(tokenizer, prompt: str, response: str) -> Sample:
    p = _encode(tokenizer, prompt)
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        p = [tokenizer.bos_token_id] + p
    r = _encode(tokenizer, response) + [tokenizer.eos_token_id]
    return Sample(p + r, [0] * len(p) + [1] * len(r))


def _is_conversation(messages) -> bool:
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages)


def _messages(tokenizer, messages, prefixes=None) -> Sample:
    """Render turn by turn: the tokens each assistant turn adds count in the loss. `prefixes`: each
    prefix already rendered (chat_prefixes.render_prefixes)."""
    if not _is_conversation(messages):
        raise ValueError('"messages" must be a list of {"role", "content"} objects')
    chat_templates.require(tokenizer)
    return sample_of_turns(chat_templates.locate_turns(tokenizer, messages, prefixes))


def sample_of_turns(turns: list[tuple[list[int], bool]]) -> Sample:
    """chat_templates.locate_turns' turns in one sample, the assistant turns' tokens trained
    (toolkit.train.vlm_data masks multimodal conversations so too)."""
    tokens: list[int] = []
    mask: list[int] = []
    for added, assistant in turns:
        tokens += added
        mask += [1 if assistant else 0] * len(added)
    return Sample(tokens, mask)


def parse_line(tokenizer, record, prefixes=None) -> Sample:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "prompt" in record and "response" in record:
        return _prompt_response(tokenizer, str(record["prompt"]), str(record["response"]))
    if "messages" in record:
        return _messages(tokenizer, record["messages"], prefixes)
    if "text" in record:
        tokens = _encode(tokenizer, str(record["text"])) + [tokenizer.eos_token_id]
        return Sample(tokens, [1] * len(tokens))
    raise ValueError('expected keys "prompt"+"response", "messages" or "text" (map other names with data.columns)')


def _truncate(sample: Sample, max_tokens: int, side: str) -> Sample:
    cut = slice(None, max_tokens) if side == "right" else slice(len(sample.tokens) - max_tokens, None)
    return Sample(sample.tokens[cut], sample.loss_mask[cut])


# Where the formats TRL and LLaMA-Factory read put images (and videos): a column beside `messages`, or a part of a
# message's content list ({"type": "image", "image": "cat.png"}; OpenAI's "image_url").
IMAGE_COLUMNS = ("images", "image", "videos", "video")
IMAGE_PART_TYPES = ("image", "image_url", "input_image", "video", "video_url")


def image_in(record) -> str | None:
    """Where `record` holds an image or a video (a non-empty image column, or an image part of a message of
    its `messages`, `prompt`, `chosen` or `rejected`), else None."""
    if not isinstance(record, dict):
        return None
    for column in IMAGE_COLUMNS:
        if record.get(column) not in (None, [], ""):
            return f"its `{column}` column"
    for key in ("messages", "prompt", "chosen", "rejected"):
        messages = record.get(key)
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    return f"{key}[{i}].content[{j}] is of type {part['type']!r}"
    return None


def parse_counted(parse, tokenizer, where: str, record, opts: ReadOptions, stats: DataStats):
    """parse(tokenizer, record), counted in stats; None for a malformed record skipped
    (data.malformed=skip), else one DataError naming where it is. A record with an image is refused
    whatever data.malformed says: training on its text alone would be training on another sample."""
    stats.lines += 1
    found = image_in(record)
    if found:
        raise DataError(f"{where}: the data holds images ({found}), and this checkpoint is a text model (images train "
                        "on a vision-language one, docs/guide/vlm.md): remove the image parts and image columns")
    try:
        if isinstance(record, Exception):
            raise record
        return parse(tokenizer, record)
    except ChatTemplateError as e:  # the template's fault, not the line's: never skipped
        raise DataError(f"{where}: {e}") from None
    except (ValueError, TypeError, KeyError) as e:
        if opts.malformed == "skip":
            stats.skipped_malformed += 1
            return None
        raise DataError(f"{where}: {e}") from None


def prerendered_parse(tokenizer, records: list):
    """parse_line for these records, their conversations' prefixes rendered in one batched call
    (chat_prefixes.render_prefixes) first: the same samples, without a tokenizer call per turn."""
    conversations = [r for r in records if isinstance(r, dict) and "messages" in r and _is_conversation(r["messages"])
                     and not ("prompt" in r and "response" in r) and image_in(r) is None]
    rendered = chat_prefixes.render_prefixes(tokenizer, [r["messages"] for r in conversations]) \
        if conversations and getattr(tokenizer, "chat_template", None) else None
    by_record = {id(r): prefixes for r, prefixes in zip(conversations, rendered or [])}
    return lambda tok, record: parse_line(tok, record, by_record.get(id(record)))


def read_samples(named: Iterable[tuple[str, object]], tokenizer, opts: ReadOptions, stats: DataStats,
                 parse=parse_line) -> list[Sample]:
    """Samples of (where, record) pairs; a record that failed to parse arrives as its exception."""
    samples = []
    unk = tokenizer.unk_token_id
    for where, record in named:
        sample = parse_counted(parse, tokenizer, where, record, opts, stats)
        if sample is None:
            continue
        if unk is not None:
            found = sample.tokens.count(unk)
            stats.unk_tokens += found
            if found and stats.unk_example is None:
                stats.unk_example = f"{where}: {str(record)[:EXAMPLE_CHARS]}"
        stats.tokens += len(sample.tokens)
        cut = False
        if len(sample.tokens) > opts.max_tokens:
            if opts.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            stats.truncated += 1
            sample, cut = _truncate(sample, opts.max_tokens, opts.truncation), True
        if not sum(sample.loss_mask[1:]):  # the first token is never a target
            if cut:
                stats.dropped_targets_truncated += 1
            else:
                stats.dropped_no_targets += 1
            continue
        samples.append(sample)
    stats.samples += len(samples)
    return samples


def read_jsonl(path: str | Path, tokenizer, max_tokens: int, overlong: str, malformed: str, stats: DataStats) -> list[Sample]:
    samples = read_samples(records(Source(str(path)), IDENTITY_COLUMNS, Path()), tokenizer,
                           ReadOptions(max_tokens, overlong, malformed), stats)
    refuse_empty(str(path), samples, stats)
    return samples


def refuse_empty(name: str, samples: list[Sample], stats: DataStats) -> None:
    if samples:
        return
    reasons = {"malformed (skipped)": stats.skipped_malformed, "overlong (dropped)": stats.dropped_overlong,
               "every trained token cut by truncation": stats.dropped_targets_truncated,
               "no token to train on": stats.dropped_no_targets}
    why = ", ".join(f"{n} {reason}" for reason, n in reasons.items() if n)
    raise DataError(f"{name} holds no usable samples ({stats.lines} read" + (f": {why})" if why else ")")
                    + (" — see data.truncation, data.overlong and data.seq_len" if stats.dropped_targets_truncated
                       or stats.dropped_overlong else ""))


def refuse_unreadable(name: str, stats: DataStats, max_share: float, tokenizer) -> None:
    """A tokenizer that reads the data as mostly `<unk>` trains on nothing: say so with an example."""
    if stats.tokens and stats.unk_tokens / stats.tokens > max_share:
        raise DataError(
            f"{name}: {stats.unk_tokens} of {stats.tokens} tokens ({stats.unk_tokens / stats.tokens:.0%}) are the "
            f"tokenizer's unknown token {tokenizer.unk_token!r}, above data.max_unk_share={max_share:g}: this tokenizer "
            f"cannot read the data (e.g. {stats.unk_example}); use the model's own tokenizer or other data")


def mixture_picks(parts: list[tuple[Source, int]], seed: int, stats: DataStats) -> list[list[int]]:
    """Several data sets (each with its sample count) in the shares data.weights gives them: the
    mixture keeps the total sample count, each source's share drawn in a seeded order (repeated when
    the share is larger than the source). Returns each source's picked sample indices, in order."""
    total, weights = sum(n for _, n in parts), sum(src.weight for src, _ in parts)
    picks = []
    for i, (src, n) in enumerate(parts):
        want = round(total * src.weight / weights)
        order = list(range(n))
        random.Random(seed + i).shuffle(order)
        picks.append([order[k % len(order)] for k in range(want)])
        stats.mixture[src.name] = want
    return picks


def mix(parts: list[tuple[Source, list[Sample]]], seed: int, stats: DataStats) -> list[Sample]:
    """The samples of several data sets mixed as mixture_picks draws them."""
    if len(parts) == 1:
        return parts[0][1]
    picks = mixture_picks([(src, len(samples)) for src, samples in parts], seed, stats)
    return [samples[k] for (_, samples), picked in zip(parts, picks) for k in picked]


@dataclass
class Row:
    """One row of a batch: seq_len + 1 tokens; `doc_ids` marks packed documents."""

    tokens: list[int]
    loss_mask: list[int]
    doc_ids: list[int] = field(default_factory=list)


def padded_row(s: Sample, length: int, pad_id: int) -> Row:
    """One sample in a row; padding has document id -1, as in packed rows."""
    n = length - len(s.tokens)
    return Row(s.tokens + [pad_id] * n, s.loss_mask + [0] * n, [0] * len(s.tokens) + [-1] * n)


def pad_rows(samples: list[Sample], length: int, pad_id: int) -> list[Row]:
    """One sample per row."""
    return [padded_row(s, length, pad_id) for s in samples]


def pack_plan(lengths: Iterable[int], length: int) -> list[int]:
    """Greedy packing in order, a sample never spanning two rows: the index of each row's first
    sample, then the sample count (row i packs samples starts[i] to starts[i + 1])."""
    starts, used, n = [], length + 1, 0  # `used` past `length`: the first sample opens a row
    for n, size in enumerate(lengths):
        if used + size > length:
            starts.append(n)
            used = 0
        used += size
    starts.append(n + 1 if starts else 0)
    return starts


def packed_row(samples: list[Sample], length: int, pad_id: int) -> Row:
    """Samples concatenated in one row, each its own document, padded to `length`."""
    row = Row([], [], [])
    for doc, s in enumerate(samples):
        row.tokens += s.tokens
        # A document's first token would be "predicted" from the previous document: never a target.
        row.loss_mask += [0] + s.loss_mask[1:]
        row.doc_ids += [doc] * len(s.tokens)
    n = length - len(row.tokens)
    row.tokens += [pad_id] * n
    row.loss_mask += [0] * n
    row.doc_ids += [-1] * n
    return row


def pack_rows(samples: list[Sample], length: int, pad_id: int) -> list[Row]:
    """Greedy packing in order (pack_plan); a sample never spans two rows."""
    starts = pack_plan((len(s.tokens) for s in samples), length)
    return [packed_row(samples[a:b], length, pad_id) for a, b in zip(starts, starts[1:])]


def collate(rows: list[Row], packed: bool) -> dict[str, torch.Tensor]:
    """Model inputs from rows of seq_len + 1 tokens: inputs t[:-1], labels t[1:]."""
    tokens = torch.tensor([r.tokens for r in rows], dtype=torch.long)
    mask = torch.tensor([r.loss_mask for r in rows], dtype=torch.float32)
    docs = torch.tensor([r.doc_ids for r in rows])[:, :-1]
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask[:, 1:], "real_tokens": (docs >= 0).sum(),
             "padding": docs < 0}
    if packed:
        seq = docs.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        same_doc = docs[:, :, None] == docs[:, None, :]
        # megatron-core convention: True = masked out. Shape [b, 1, s, s].
        batch["attention_mask"] = ~(causal[None] & same_doc)[:, None]
    return batch


@dataclass(frozen=True)
class GlobalCounts:
    """Token counts of one whole global batch (all DP ranks' rows)."""

    loss_tokens: int  # targets that count in the loss (the normaliser)
    real_tokens: int  # non-padding input tokens (throughput)

    @classmethod
    def of(cls, rows: list[Row]) -> "GlobalCounts":
        # As collate: inputs are tokens[:-1], targets tokens[1:].
        return cls(sum(sum(r.loss_mask[1:]) for r in rows), sum(sum(d >= 0 for d in r.doc_ids[:-1]) for r in rows))


class BatchSource:
    """Deterministic order over rows; each DP rank reads its own slice of every global batch.

    State is the number of rows consumed, so a resumed run continues exactly where it stopped.
    """

    def __init__(self, rows: list[Row], global_batch: int, micro_batch: int, dp: int, dp_rank: int,
                 seed: int, shuffle: bool, packed: bool, cp: int = 1, cp_rank: int = 0, length: int | None = None):
        """`cp` > 1: each micro-batch padded to `length` tokens and cut to this CP rank's chunks
        (toolkit.blocks.context_parallel); every CP rank of a DP rank reads the same rows."""
        if global_batch % (micro_batch * dp):
            raise DataError(f"global batch {global_batch} is not divisible by micro batch {micro_batch} x DP {dp}")
        self.rows, self.global_batch, self.micro_batch = rows, global_batch, micro_batch
        self.dp, self.dp_rank, self.seed, self.shuffle, self.packed = dp, dp_rank, seed, shuffle, packed
        self.cp, self.cp_rank, self.length = cp, cp_rank, length
        self.consumed = 0
        self.last_counts = GlobalCounts(0, 0)
        self._orders: dict[int, list[int]] = {}

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch's order
        return self._orders[epoch]

    def _global_indices(self, start: int) -> list[int]:
        n = len(self.rows)
        out = []
        for i in range(start, start + self.global_batch):
            epoch, pos = divmod(i, n)
            out.append(self._order(epoch)[pos])
        return out

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]:
        """This DP rank's micro-batches of the next global batch. Every rank knows the whole global
        batch, so its token counts (`last_counts`, the loss normaliser) need no collective; rows
        mapped from a prepared cache (toolkit.train.row_views) count from their index, so a rank
        reads the tokens of its own micro-batches only."""
        indices = self._global_indices(self.consumed)
        self.consumed += self.global_batch
        counts = getattr(self.rows, "counts", None)
        self.last_counts = counts(indices) if counts else self._counts([self.rows[i] for i in indices])
        per_rank = self.global_batch // self.dp
        mine = [self.rows[i] for i in indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]]
        batches = [self._collate(mine[i : i + self.micro_batch]) for i in range(0, per_rank, self.micro_batch)]
        if self.cp == 1:
            return batches
        from toolkit.blocks.context_parallel import pad_batch, split_batch

        return [split_batch(pad_batch(b, self.length), self.cp, self.cp_rank) for b in batches]

    def _collate(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        return collate(rows, self.packed)

    def _counts(self, rows: list[Row]) -> GlobalCounts:
        return GlobalCounts.of(rows)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def pad_token(tokenizer) -> int:
    """Tokenizers without a pad token (Llama 3) pad with EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def to_rows(samples: list[Sample], tokenizer, seq_len: int, pack: bool, stats: DataStats) -> list[Row]:
    pad_id = pad_token(tokenizer)
    rows = pack_rows(samples, seq_len + 1, pad_id) if pack else pad_rows(samples, seq_len + 1, pad_id)
    stats.packed_rows = len(rows) if pack else 0
    return rows


def load_rows(path, tokenizer, seq_len: int, pack: bool, overlong: str, malformed: str) -> tuple[list[Row], DataStats]:
    stats = DataStats()
    samples = read_jsonl(path, tokenizer, seq_len + 1, overlong, malformed, stats)
    return to_rows(samples, tokenizer, seq_len, pack, stats), stats
