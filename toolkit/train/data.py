"""Instruction data: JSONL -> token sequences with a loss mask -> deterministic DP-sharded batches.

Line formats:
  {"prompt": ..., "response": ...}   prompt tokens are masked out of the loss
  {"messages": [{"role", "content"}]} rendered with the tokenizer's chat template; only assistant
                                      turns count in the loss
  {"text": ...}                       every token counts
EOS is appended after each response/text. Tokenizers without a pad token (Llama 3) pad with EOS;
padded positions never count in the loss, and causal attention keeps them from affecting real ones.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.errors import ToolkitError


class DataError(ToolkitError):
    """A data file is missing, empty or malformed."""


@dataclass
class Sample:
    tokens: list[int]
    loss_mask: list[int]  # 1 where tokens[i] is a target to predict


@dataclass
class DataStats:
    lines: int = 0
    skipped_malformed: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    packed_rows: int = 0


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_response(tokenizer, prompt: str, response: str) -> Sample:
    p = _encode(tokenizer, prompt)
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        p = [tokenizer.bos_token_id] + p
    r = _encode(tokenizer, response) + [tokenizer.eos_token_id]
    return Sample(p + r, [0] * len(p) + [1] * len(r))


def _messages(tokenizer, messages: list[dict]) -> Sample:
    """Render turn by turn: the tokens each assistant turn adds count in the loss."""
    tokens: list[int] = []
    mask: list[int] = []
    for i in range(len(messages)):
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, add_generation_prompt=False)
        if hasattr(rendered, "keys"):
            rendered = rendered["input_ids"]
        if rendered[: len(tokens)] != tokens:
            raise ValueError("the chat template does not render conversations incrementally")
        added = rendered[len(tokens) :]
        tokens += added
        mask += [1 if messages[i].get("role") == "assistant" else 0] * len(added)
    return Sample(tokens, mask)


def parse_line(tokenizer, record) -> Sample:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "prompt" in record and "response" in record:
        return _prompt_response(tokenizer, str(record["prompt"]), str(record["response"]))
    if "messages" in record:
        return _messages(tokenizer, record["messages"])
    if "text" in record:
        tokens = _encode(tokenizer, str(record["text"])) + [tokenizer.eos_token_id]
        return Sample(tokens, [1] * len(tokens))
    raise ValueError('expected keys "prompt"+"response", "messages" or "text"')


def read_jsonl(path: str | Path, tokenizer, max_tokens: int, overlong: str, malformed: str, stats: DataStats) -> list[Sample]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    samples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                sample = parse_line(tokenizer, json.loads(line))
            except (ValueError, TypeError, KeyError) as e:
                if malformed == "skip":
                    stats.skipped_malformed += 1
                    continue
                raise DataError(f"{path}:{lineno}: {e}") from None
            if len(sample.tokens) > max_tokens:
                if overlong == "drop":
                    stats.dropped_overlong += 1
                    continue
                stats.truncated += 1
                sample = Sample(sample.tokens[:max_tokens], sample.loss_mask[:max_tokens])
            if sum(sample.loss_mask[1:]):
                samples.append(sample)
    if not samples:
        raise DataError(f"{path} holds no usable samples")
    return samples


@dataclass
class Row:
    """One row of a batch: seq_len + 1 tokens; `doc_ids` marks packed documents."""

    tokens: list[int]
    loss_mask: list[int]
    doc_ids: list[int] = field(default_factory=list)


def pad_rows(samples: list[Sample], length: int, pad_id: int) -> list[Row]:
    """One sample per row; padding has document id -1, as in packed rows."""
    return [
        Row(s.tokens + [pad_id] * (length - len(s.tokens)), s.loss_mask + [0] * (length - len(s.tokens)),
            [0] * len(s.tokens) + [-1] * (length - len(s.tokens)))
        for s in samples
    ]


def pack_rows(samples: list[Sample], length: int, pad_id: int) -> list[Row]:
    """Greedy packing in order; a sample never spans two rows."""
    rows, cur = [], Row([], [], [])
    for s in samples:
        if len(cur.tokens) + len(s.tokens) > length:
            rows.append(cur)
            cur = Row([], [], [])
        doc = (cur.doc_ids[-1] + 1) if cur.doc_ids else 0
        cur.tokens += s.tokens
        # A document's first token would be "predicted" from the previous document: never a target.
        cur.loss_mask += [0] + s.loss_mask[1:]
        cur.doc_ids += [doc] * len(s.tokens)
    if cur.tokens:
        rows.append(cur)
    for r in rows:
        n = length - len(r.tokens)
        r.tokens += [pad_id] * n
        r.loss_mask += [0] * n
        r.doc_ids += [-1] * n
    return rows


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
                 seed: int, shuffle: bool, packed: bool):
        if global_batch % (micro_batch * dp):
            raise DataError(f"global batch {global_batch} is not divisible by micro batch {micro_batch} x DP {dp}")
        self.rows, self.global_batch, self.micro_batch = rows, global_batch, micro_batch
        self.dp, self.dp_rank, self.seed, self.shuffle, self.packed = dp, dp_rank, seed, shuffle, packed
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

    def _global_rows(self, start: int) -> list[Row]:
        n = len(self.rows)
        out = []
        for i in range(start, start + self.global_batch):
            epoch, pos = divmod(i, n)
            out.append(self.rows[self._order(epoch)[pos]])
        return out

    def next_global_batch(self) -> list[dict[str, torch.Tensor]]:
        """This DP rank's micro-batches of the next global batch. Every rank knows the whole global
        batch, so its token counts (`last_counts`, the loss normaliser) need no collective."""
        rows = self._global_rows(self.consumed)
        self.consumed += self.global_batch
        self.last_counts = GlobalCounts.of(rows)
        per_rank = self.global_batch // self.dp
        mine = rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [collate(mine[i : i + self.micro_batch], self.packed) for i in range(0, per_rank, self.micro_batch)]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def load_rows(path, tokenizer, seq_len: int, pack: bool, overlong: str, malformed: str) -> tuple[list[Row], DataStats]:
    stats = DataStats()
    samples = read_jsonl(path, tokenizer, seq_len + 1, overlong, malformed, stats)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = pack_rows(samples, seq_len + 1, pad_id) if pack else pad_rows(samples, seq_len + 1, pad_id)
    stats.packed_rows = len(rows) if pack else 0
    return rows, stats
