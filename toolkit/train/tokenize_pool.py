"""Records -> tokenized chunks, on every core: the one tokenizing code (toolkit.train.data's
read_samples, toolkit.train.preference's read_pairs) run by worker processes on chunks of records.

The records are read in order by this process and dealt out in chunks; the chunks come back in
order, so samples, counts and the first refusal are those of a read in one process. The workers
are forked, inheriting the tokenizer (a fast tokenizer's Rust threads are turned off in them: the
processes are the parallelism). A source of one chunk is tokenized here, without a pool.

The workers are a concurrent.futures process pool, shut down without killing them when the reader
stops early (a full disk, a refusal): multiprocessing.Pool.terminate() deadlocked there, its task
handler waiting for the task queue's lock while the main thread joined it (Python 3.12; seen as
tests/test_prepared_data.py's full-disk test hanging, and reproduced by abandoning pools in a loop).
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from toolkit.train.data import DataStats, ReadOptions, prerendered_parse, read_samples
from toolkit.train.data_sources import DataError

CHUNK_RECORDS = 512  # records a worker tokenizes at a time: large against the pickling, small against memory
IN_FLIGHT_PER_PROCESS = 4  # chunks read ahead per worker: none waits, and the records in memory stay bounded


@dataclass
class Chunk:
    """A chunk's samples as flat arrays (pairs: chosen, rejected, ... as sequences), its counts, or its refusal."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    stats: DataStats
    error: str | None = None


_work: tuple | None = None  # (tokenizer, opts, method) of the workers, set before they fork


def tokenize_chunk(records: list, tokenizer, opts: ReadOptions, method: str) -> Chunk:
    from toolkit.train.preference import read_pairs

    stats = DataStats()
    try:
        if method == "dpo":
            samples = [s for pair in read_pairs(records, tokenizer, opts, stats) for s in pair]
        else:
            parse = prerendered_parse(tokenizer, [record for _, record in records])
            samples = read_samples(records, tokenizer, opts, stats, parse)
    except DataError as e:
        return Chunk(*_empty(), stats, error=str(e))
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=len(samples))
    tokens = np.fromiter(itertools.chain.from_iterable(s.tokens for s in samples), dtype=np.uint32, count=int(lengths.sum()))
    mask = np.fromiter(itertools.chain.from_iterable(s.loss_mask for s in samples), dtype=np.uint8, count=len(tokens))
    targets = np.fromiter((sum(s.loss_mask[1:]) for s in samples), dtype=np.int32, count=len(samples))
    return Chunk(tokens, mask, lengths, targets, stats)


def _empty():
    return (np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int32))


def _worker_start() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _worker_chunk(records: list) -> Chunk:
    return tokenize_chunk(records, *_work)


def _chunks(named: Iterable, size: int) -> Iterator[list]:
    it = iter(named)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def tokenize(named: Iterable, tokenizer, opts: ReadOptions, method: str, num_proc: int,
             chunk_records: int = CHUNK_RECORDS) -> Iterator[Chunk]:
    """Chunks of (where, record) pairs tokenized on `num_proc` processes, in order. A chunk's
    refusal (a malformed record, a template that fails) ends the iteration with its DataError."""
    chunks = _chunks(named, chunk_records)
    first = list(itertools.islice(chunks, 2))
    if num_proc <= 1 or len(first) < 2:
        results = (tokenize_chunk(c, tokenizer, opts, method) for c in itertools.chain(first, chunks))
        yield from _raising(results)
        return
    global _work
    _work = (tokenizer, opts, method)
    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start)
    try:
        yield from _raising(_bounded_map(pool, itertools.chain(first, chunks), IN_FLIGHT_PER_PROCESS * num_proc))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the chunks already running take milliseconds
        _work = None


def _bounded_map(pool: ProcessPoolExecutor, chunks: Iterator[list], window: int) -> Iterator[Chunk]:
    """pool.map in order with at most `window` chunks read ahead (map itself reads its whole input at once)."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(_worker_chunk, chunk))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _raising(results: Iterable[Chunk]) -> Iterator[Chunk]:
    for chunk in results:
        if chunk.error is not None:
            raise DataError(chunk.error)
        yield chunk


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
