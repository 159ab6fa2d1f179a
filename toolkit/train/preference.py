"""Preference data (method: dpo): records -> (prompt, chosen, rejected) token ids -> pairs of rows.

Record formats, TRL's (columns renamed by data.columns first):
  {"prompt": str, "chosen": str, "rejected": str}     EOS text appended to each completion that lacks it
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   rendered with the chat template
  {"chosen": [messages], "rejected": [messages]}      the prompt is the turns both share (TRL's extract_prompt)

Tokenised as TRL 1.16's DPOTrainer does (`_prepare_dataset`): the prompt alone (with the generation
prompt, for messages) and prompt + completion are tokenised whole, and the completion starts where
they first differ, so a token merged across the boundary belongs to the completion, as there. Each
completion's tokens are the ones its log-probability sums over; the prompt is masked.

Truncation (TRL's collator, with max_length = data.seq_len + 1 tokens per sequence): data.truncation
right keeps each sequence's start (TRL's keep_start; a pair whose prompt alone fills the length is
dropped, as TRL drops it), left keeps its end (keep_end); data.overlong=drop drops an overlong pair.
A pair is two rows, chosen then rejected, kept in the same micro-batch on the same DP rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from toolkit.train import chat_templates
from toolkit.train.chat_templates import ChatTemplateError
from toolkit.train.data import (EXAMPLE_CHARS, BatchSource, DataStats, GlobalCounts, ReadOptions, Row, Sample, collate,
                                pad_rows, pad_token, parse_counted)


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass
class PairRow:
    chosen: Row
    rejected: Row


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def split_prompt(chosen, rejected):
    """The shared start of chosen and rejected as the prompt (TRL's extract_prompt): the turns both
    conversations share, or the characters both texts share (a space before the split goes with the
    completion)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer, messages, generation_prompt: bool) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception
        raise ChatTemplateError(f"the chat template fails to render: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return list(out["input_ids"])


def parse_pair(tokenizer, record) -> Pair:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "chosen" not in record or "rejected" not in record:
        raise ValueError('method=dpo expects keys "chosen" and "rejected" (and "prompt", or conversations that share '
                         'their first turns); map other names with data.columns')
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record["prompt"] if "prompt" in record else None
    conversational = _is_messages(chosen)
    if conversational != _is_messages(rejected) or (prompt is not None and conversational != _is_messages(prompt)):
        raise ValueError('"prompt", "chosen" and "rejected" must all be text or all be lists of {"role", "content"}')
    if not conversational and not all(isinstance(v, str) for v in (chosen, rejected, "" if prompt is None else prompt)):
        raise ValueError('"prompt", "chosen" and "rejected" must be text or lists of {"role", "content"}')
    if prompt is None:
        prompt, chosen, rejected = split_prompt(chosen, rejected)
    if not chosen or not rejected:
        raise ValueError("chosen and rejected are the same (or one is empty): nothing to prefer")
    if conversational:
        chat_templates.require(tokenizer)
        prompt_ids = _render(tokenizer, prompt, True)
        chosen_ids, rejected_ids = (_render(tokenizer, prompt + c, False) for c in (chosen, rejected))
    else:
        eos = tokenizer.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = tokenizer(prompt)["input_ids"]
        chosen_ids, rejected_ids = (tokenizer(prompt + c)["input_ids"] for c in (chosen, rejected))
    n = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    return Pair(prompt_ids[:n], chosen_ids[n:], rejected_ids[n:])


def _sequences(pair: Pair, opts: ReadOptions) -> tuple[Sample, Sample] | None:
    """(chosen, rejected) samples cut to opts.max_tokens; None when the pair is dropped."""
    out = []
    for completion in (pair.chosen, pair.rejected):
        tokens, mask = pair.prompt + completion, [0] * len(pair.prompt) + [1] * len(completion)
        cut = slice(None, opts.max_tokens) if opts.truncation == "right" else slice(-opts.max_tokens, None)
        out.append(Sample(tokens[cut], mask[cut]))
    if not all(sum(s.loss_mask[1:]) for s in out):  # the first token is never a target
        return None
    return out[0], out[1]


def read_pairs(named: Iterable[tuple[str, object]], tokenizer, opts: ReadOptions, stats: DataStats) -> list[tuple[Sample, Sample]]:
    pairs = []
    for where, record in named:
        pair = parse_counted(parse_pair, tokenizer, where, record, opts, stats)
        if pair is None:
            continue
        lengths = [len(pair.prompt) + len(c) for c in (pair.chosen, pair.rejected)]
        stats.tokens += sum(lengths)
        if tokenizer.unk_token_id is not None:
            found = sum((pair.prompt + c).count(tokenizer.unk_token_id) for c in (pair.chosen, pair.rejected))
            stats.unk_tokens += found
            if found and stats.unk_example is None:
                stats.unk_example = f"{where}: {str(record)[:EXAMPLE_CHARS]}"
        overlong = max(lengths) > opts.max_tokens
        if overlong and opts.overlong == "drop":
            stats.dropped_overlong += 1
            continue
        if opts.truncation == "right" and len(pair.prompt) >= opts.max_tokens:  # TRL drops these too
            stats.dropped_targets_truncated += 1
            continue
        sequences = _sequences(pair, opts)
        if sequences is None:
            stats.dropped_targets_truncated += 1
            continue
        stats.truncated += overlong
        pairs.append(sequences)
    stats.samples += len(pairs)
    return pairs


def to_pair_rows(pairs: list[tuple[Sample, Sample]], tokenizer, seq_len: int) -> list[PairRow]:
    pad_id = pad_token(tokenizer)
    chosen = pad_rows([c for c, _ in pairs], seq_len + 1, pad_id)
    rejected = pad_rows([r for _, r in pairs], seq_len + 1, pad_id)
    return [PairRow(c, r) for c, r in zip(chosen, rejected)]


class PairSource(BatchSource):
    """BatchSource over pairs: global_batch and micro_batch count pairs; a micro-batch of m pairs is
    2m rows, the m chosen then the m rejected (TRL's layout). The loss normaliser is the number of
    pairs of the global batch."""

    def __init__(self, rows: list[PairRow], global_batch: int, micro_batch: int, dp: int, dp_rank: int, seed: int,
                 shuffle: bool):
        super().__init__(rows, global_batch, micro_batch, dp, dp_rank, seed, shuffle, packed=False)

    def _collate(self, rows: list[PairRow]) -> dict[str, torch.Tensor]:
        batch = collate([r.chosen for r in rows] + [r.rejected for r in rows], packed=False)
        batch["pairs"] = len(rows)
        return batch

    def _counts(self, rows: list[PairRow]) -> GlobalCounts:
        sequences = GlobalCounts.of([r.chosen for r in rows] + [r.rejected for r in rows])
        return GlobalCounts(len(rows), sequences.real_tokens)
