"""Prepare a data source once, and open it on every later start: one process writes, the others wait.

`prepared_source` keys the source (toolkit.train.prepared_key), opens its prepared directory when
it is there and whole, and otherwise prepares it under a lock file next to it: the first process
to take the lock tokenizes (toolkit.train.tokenize_pool, on every core) and writes the directory
(toolkit.train.prepared_store, renamed into place when complete); the others wait on the lock and
then open what it wrote. The lock is the file system's (flock), so the writer is one process per
file system: one per node on node-local disks, one in all on a shared file system that honours
flock. Where flock is refused, every process writes its own temporary copy and the first rename
wins; the others open the winner's.

A damaged directory (toolkit.train.prepared_store.DamagedStore) is said in one line and prepared
again. A refusal while tokenizing (a malformed record, a template that fails) is kept next to the
directory as .NAME.refused, so that the waiting processes, and a later start with the same inputs,
refuse in the same line without tokenizing again. A full disk is one line and leaves nothing; the
processes waiting on that writer are told the same line (.NAME.failed) instead of trying again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from toolkit.atomic import atomic_directory, is_disk_full, write_file
from toolkit.errors import ToolkitError
from toolkit.train import data_sources
from toolkit.train.data import DataStats, ReadOptions
from toolkit.train.data_sources import DataError, Source
from toolkit.train.prepared_key import directory_name, key_fields
from toolkit.train.prepared_store import DamagedStore, SampleStore, StoreWriter
from toolkit.train.remembered_digests import remembered_digest
from toolkit.train.tokenize_pool import CHUNK_RECORDS, tokenize

PREPARED = "prepared"  # under data.cache_dir
DIGESTS = ".digests"  # under PREPARED: the data files' digests, remembered by their stat (remembered_digests)
MIN_CHUNK_RECORDS = 64  # a source of fewer than two chunks of these is tokenized without a pool
PROGRESS_EVERY_S = 30.0  # a plain progress line this often in a log (a terminal gets a bar)
_NO_LOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@dataclass(frozen=True)
class PrepareSettings:
    cache_dir: Path  # data.cache_dir: `datasets`' cache, and PREPARED/ under it
    num_proc: int  # tokenizing processes
    verify: bool = False  # every array's BLAKE3 checked on open
    say: Callable[[str], None] = print  # the lines a person reads (rank 0's)
    chunk_records: int = CHUNK_RECORDS


def prepared_source(source: Source, tokenizer, tokenizer_digest: str, opts: ReadOptions, method: str,
                    settings: PrepareSettings) -> SampleStore:
    """The prepared samples of `source` (pairs' sequences for method=dpo), prepared now if needed."""
    memo = settings.cache_dir / PREPARED / DIGESTS
    fingerprint = data_sources.content_fingerprint(source, settings.cache_dir, lambda p: remembered_digest(p, memo))
    fields = key_fields(source, fingerprint, tokenizer_digest, opts, method)
    final = settings.cache_dir / PREPARED / directory_name(fields)
    store = _open(final, settings, rebuild_damaged=False)
    if store is not None:
        return store
    final.parent.mkdir(parents=True, exist_ok=True)
    waiting_since = time.time()
    with _prepare_lock(final, settings.say) as (locked, waited):
        refused, failed = (final.parent / f".{final.name}.{end}" for end in ("refused", "failed"))
        if refused.is_file():
            raise DataError(refused.read_text())
        if waited and failed.is_file() and failed.stat().st_mtime >= waiting_since:
            raise ToolkitError(failed.read_text())  # the writer we waited for failed (a full disk): not again
        store = _open(final, settings, rebuild_damaged=True)
        if store is not None:
            return store
        try:
            _write(final, fields, source, tokenizer, opts, method, settings)
        except DamagedStore:
            raise
        except DataError as e:  # the inputs' own verdict: the same whenever they are read again
            _keep_note(refused, str(e))
            raise
        except ToolkitError as e:
            if not locked and final.is_dir():  # no lock: another process's copy was renamed first
                return SampleStore.open(final)
            _keep_note(failed, str(e))  # for the processes waiting now only
            raise
        failed.unlink(missing_ok=True)
    return SampleStore.open(final)


def _open(final: Path, settings: PrepareSettings, rebuild_damaged: bool) -> SampleStore | None:
    if not final.is_dir():
        return None
    try:
        return SampleStore.open(final, verify=settings.verify)
    except DamagedStore as e:
        if not rebuild_damaged:
            return None  # said and rebuilt under the lock, by one process
        print(f"{e}: preparing it again", file=sys.stderr, flush=True)
        aside = final.parent / f".{final.name}.damaged-{os.getpid()}"
        os.rename(final, aside)  # out of every opener's way at once, then deleted
        shutil.rmtree(aside, ignore_errors=True)
        return None


def _keep_note(path: Path, message: str) -> None:
    try:
        write_file(path, message)
    except ToolkitError:
        pass  # a full disk may refuse it: the error is still raised, only its reuse is lost


@contextmanager
def _prepare_lock(final: Path, say: Callable[[str], None]):
    """Hold .NAME.prepare-lock (flock, released by the kernel if the process dies); yields whether
    the file system gave the lock, and whether another process held it first."""
    fd = os.open(final.parent / f".{final.name}.prepare-lock", os.O_RDWR | os.O_CREAT, 0o644)
    waited = False
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = True
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                say(f"waiting for {holder} to prepare the data into {final}")
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_LOCK_ERRNOS:
                raise
            yield False, False
            return
        try:  # who holds it, for the waiters' line (informational: a full disk may refuse it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError:
            pass
        yield True, waited
    finally:
        os.close(fd)


def _write(final: Path, fields: dict, source: Source, tokenizer, opts: ReadOptions, method: str,
           settings: PrepareSettings) -> None:
    began = time.monotonic()
    try:
        total = data_sources.count_records(source, settings.cache_dir)
    except (OSError, DataError):
        total = None  # the read below says what is wrong
    progress = PrepareProgress(source.name, total)
    stats = DataStats()
    try:
        with atomic_directory(final) as tmp:
            writer = StoreWriter(tmp)
            try:
                named = data_sources.records(source, opts.columns, settings.cache_dir)
                chunk_records = settings.chunk_records
                if total:  # every process busy on a smaller source too (MIN_CHUNK_RECORDS keeps tiny ones in one)
                    chunk_records = max(MIN_CHUNK_RECORDS, min(chunk_records, -(-total // (4 * settings.num_proc))))
                for chunk in tokenize(named, tokenizer, opts, method, settings.num_proc, chunk_records):
                    writer.append(chunk.tokens, chunk.loss_mask, chunk.lengths, chunk.targets)
                    first = not stats.lines
                    stats.add(chunk.stats)
                    progress.update(stats.lines, stats.tokens)
                    if first and total:
                        _refuse_what_will_not_fit(source, final, writer, stats.lines, total)
                writer.finish(fields, method, stats, time.monotonic() - began)
            finally:
                writer.close()
    except ToolkitError as e:
        if is_disk_full(e):
            raise ToolkitError(f"no space left on the device while preparing {source.name} into {final.parent} "
                            f"(nothing was left there): free space or set data.cache_dir to a larger disk") from None
        raise
    finally:
        progress.close()
    progress.done(stats, final, time.monotonic() - began)


def _refuse_what_will_not_fit(source: Source, final: Path, writer: StoreWriter, rows: int, total: int) -> None:
    """One line now, rather than a full disk later, when the arrays' size projected from the first
    chunk's rows is above the free space."""
    from toolkit.atomic import human_bytes

    written = writer.bytes_written()
    needed = written * total / max(rows, 1)
    free = shutil.disk_usage(writer.directory).free
    if needed - written > free:
        raise ToolkitError(f"{source.name} will not fit: preparing its {total:,} rows needs about {human_bytes(needed)} "
                           f"(projected from its first {rows:,}) and {human_bytes(free)} is free under {final.parent}: "
                           "free space or set data.cache_dir to a larger disk")


class PrepareProgress:
    """Rows read, tokens per second and the time left: a bar on a terminal, a line now and then in a log."""

    def __init__(self, name: str, total: int | None, stream=None):
        from toolkit.train.progress import interactive

        self.name, self.total, self.stream = name, total, stream or sys.stderr
        self.began = self.last_line = time.monotonic()
        self.rows = 0
        self.bar = None
        if interactive(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"preparing {Path(name).name}", unit="rows", file=self.stream,
                            dynamic_ncols=True)

    def update(self, rows: int, tokens: int) -> None:
        now = time.monotonic()
        rate = tokens / max(now - self.began, 1e-9)
        if self.bar is not None:
            self.bar.update(rows - self.rows)
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
        elif now - self.last_line >= PROGRESS_EVERY_S:
            from toolkit.train.progress import duration

            left = ""
            if self.total and rows:
                left = f", ETA {duration((now - self.began) * (self.total - rows) / rows)}"
            of = f" of {self.total:,}" if self.total else ""
            print(f"preparing {self.name}: {rows:,}{of} rows, {rate:,.0f} tokens/s{left}", file=self.stream, flush=True)
            self.last_line = now
        self.rows = rows

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def done(self, stats: DataStats, final: Path, seconds: float) -> None:
        print(f"prepared {self.name}: {stats.lines:,} rows, {stats.samples:,} kept, {stats.tokens:,} tokens in "
              f"{seconds:.1f} s ({stats.tokens / max(seconds, 1e-9):,.0f} tokens/s) into {final}", file=self.stream,
              flush=True)
