"""Copy a shard's bytes file to file, without building the tensor in memory.

Where a split kind describes a shard as row pieces of HF tensors (toolkit.splits.RowPiece), the
shard is a list of byte ranges of the safetensors files, copied into the output by the kernel
with no tensor built. No dtype cast happens on conversion, so the bytes are the tensor's bytes.
* A large range (a dim-0 split, a q/k/v group, the embedding's rows) is one `copy_file_range`
  (no pass through user space).
* Short ranges (a row-parallel split copies each row's column slice: 3-8 KiB at 1-3B sizes) are
  gathered: the source span they lie in is mapped read-only, and one `pwritev` writes up to
  IOV_MAX of them from the mapping, so the kernel copies each byte once, from the source's page
  cache into the output's, as copy_file_range does. Building such a shard as a tensor first wrote
  it into fresh anonymous memory with a strided copy, then wrote that into the page cache: two
  writes of fresh memory per byte, the costly part on this machine (see benchmarks/convert_bench.py).
* Ranges so short that Python's work per range (~1 us) outweighs the copy are built as a tensor.

Where `copy_file_range` is refused (another file system, an old kernel: EXDEV, ENOSYS, ...) or a
file cannot be mapped, the ranges are copied with pread/pwrite through a bounded buffer instead.
"""

from __future__ import annotations

import errno
import itertools
import math
import mmap
import os
from pathlib import Path
from typing import NamedTuple, Sequence

from toolkit.splits import Geometry, RowPiece, SplitKind, build_shard

# Below this, a shard is built as a tensor: Python spends ~1 us per range (describing and
# gathering it), which at under 1 KiB costs more than building the tensor does.
MIN_RANGE_BYTES = 1 << 10
# Below this, ranges are gathered from a mapping with pwritev; from it up, one copy_file_range each
# (measured 16 us per 8 KiB copy_file_range here: 0.5 GB/s; 64 KiB: ~2 GB/s).
GATHER_BELOW = 64 << 10
_MAP_WINDOW = 64 << 20  # the most of a source file mapped at once (bounded memory)
_IOV_MAX = 1024  # buffers per pwritev (Linux's IOV_MAX)
_CALL_BYTES = 64 << 20  # per copy_file_range call; the copy stays interruptible and progress even
_BUFFER_BYTES = 8 << 20  # the fallback's bounce buffer
# copy_file_range's answers meaning "not between these files", not "the copy failed".
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}
_copy_file_range = getattr(os, "copy_file_range", None)  # None: not on this platform (tests set it)


class ByteRange(NamedTuple):
    """`length` bytes at `offset` of `file`; file None: zeros."""

    file: Path | None
    offset: int
    length: int


def _piece_ranges(src, piece: RowPiece, row_bytes: int) -> list[ByteRange]:
    if piece.name is None:
        return [ByteRange(None, 0, (piece.stop - piece.start) * row_bytes)]
    entry = src.tensors[piece.name]
    row_bytes = math.prod(entry.shape[1:]) * entry.itemsize
    if piece.cols is None:
        return [ByteRange(entry.file, entry.offset + piece.start * row_bytes, (piece.stop - piece.start) * row_bytes)]
    first, width = piece.cols.start * entry.itemsize, (piece.cols.stop - piece.cols.start) * entry.itemsize
    return [ByteRange(entry.file, entry.offset + r * row_bytes + first, width) for r in range(piece.start, piece.stop)]


def _merged(ranges: list[ByteRange]) -> list[ByteRange]:
    out: list[ByteRange] = []
    for r in ranges:
        if r.length == 0:
            continue
        last = out[-1] if out else None
        if last and last.file == r.file and (r.file is None or last.offset + last.length == r.offset):
            out[-1] = last._replace(length=last.length + r.length)
        else:
            out.append(r)
    return out


def shard_ranges(split: SplitKind, src, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> list[ByteRange] | None:
    """The bytes of build_shard(split, src, names, tp, rank, geo) as ranges of the HF files, or
    None where the split kind does not describe them or a range is under MIN_RANGE_BYTES."""
    pieces = split.row_pieces(src, names, tp, rank, geo)
    if pieces is None:
        return None
    template = src.tensors[next(p.name for p in pieces if p.name is not None)]
    row_bytes = math.prod(template.shape[1:]) * template.itemsize
    ranges = _merged([r for piece in pieces for r in _piece_ranges(src, piece, row_bytes)])
    return ranges if all(r.length >= MIN_RANGE_BYTES for r in ranges if r.file is not None) else None


def shard_or_ranges(split: SplitKind, src, names: Sequence[str], tp: int, rank: int, geo: Geometry):
    """A shard as byte ranges to copy where it can be, else the built tensor."""
    ranges = shard_ranges(split, src, names, tp, rank, geo)
    return ranges if ranges is not None else build_shard(split, src, names, tp, rank, geo)


def _copy_in_kernel(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
    """Bytes copied with copy_file_range before it was refused (all of them when it was not)."""
    global _copy_file_range
    done = 0
    while done < length and _copy_file_range is not None:
        try:
            copied = _copy_file_range(src_fd, dst_fd, min(length - done, _CALL_BYTES), src_offset + done,
                                      dst_offset + done)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            _copy_file_range = None  # the rest of the run copies through a buffer
            break
        if copied == 0:
            raise OSError(errno.EIO, f"source ended {length - done} bytes early")
        done += copied
    return done


def _copy_buffered(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> None:
    buffer = memoryview(bytearray(min(length, _BUFFER_BYTES)))
    done = 0
    while done < length:
        got = os.preadv(src_fd, [buffer[: min(length - done, len(buffer))]], src_offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"source ended {length - done} bytes early")
        write_all(dst_fd, buffer[:got], dst_offset + done)
        done += got


def write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # a pwrite may write less than asked (Linux: at most ~2 GiB per call)
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_zeros(fd: int, offset: int, length: int) -> None:
    zeros = memoryview(bytes(min(length, _BUFFER_BYTES)))
    while length:
        n = min(length, len(zeros))
        write_all(fd, zeros[:n], offset)
        offset, length = offset + n, length - n


def _gathered_run(ranges: Sequence[ByteRange], first: int) -> list[ByteRange]:
    """The short ranges from ranges[first] on that lie in one file, in order, within one mapping window."""
    head = ranges[first]
    run = [head]
    for r in itertools.islice(ranges, first + 1, None):
        same_file = r.file is head.file or r.file == head.file
        if (not same_file or r.length >= GATHER_BELOW or r.offset < run[-1].offset + run[-1].length
                or r.offset + r.length - head.offset > _MAP_WINDOW):
            break
        run.append(r)
    return run


def _pwritev_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    done = 0  # buffers fully written
    while done < len(buffers):
        written = os.pwritev(fd, buffers[done:done + _IOV_MAX], offset)
        if written == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while done < len(buffers) and written >= len(buffers[done]):
            written -= len(buffers[done])
            done += 1
        if written:  # a short write stopped inside this buffer
            buffers[done] = buffers[done][written:]


def _write_gathered(src_fd: int, run: list[ByteRange], dst_fd: int, dst_offset: int) -> None:
    """Write the ranges of `run` one after the other from a read-only mapping of their span."""
    base = run[0].offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    span = run[-1].offset + run[-1].length - base
    try:  # populated at once: one page-table fill for the span, not a fault per 64 KiB
        mapping = mmap.mmap(src_fd, span, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ, offset=base)
    except (OSError, ValueError):  # a file that cannot be mapped
        at = dst_offset
        for r in run:
            _copy_buffered(src_fd, dst_fd, r.offset, at, r.length)
            at += r.length
        return
    view = memoryview(mapping)
    buffers = [view[r.offset - base: r.offset - base + r.length] for r in run]
    try:
        _pwritev_all(dst_fd, buffers, dst_offset)
    finally:
        buffers = None  # the slices go first: a mapping with views of it cannot be closed
        view.release()
        mapping.close()


def copy_ranges(ranges: Sequence[ByteRange], dst_fd: int, dst_offset: int) -> int:
    """Copy the ranges, one after the other, to dst_fd at dst_offset; returns the bytes written."""
    at, i = dst_offset, 0
    while i < len(ranges):
        r = ranges[i]
        if r.file is None:
            _write_zeros(dst_fd, at, r.length)
            at, i = at + r.length, i + 1
            continue
        run = _gathered_run(ranges, i) if r.length < GATHER_BELOW else [r]
        src_fd = os.open(r.file, os.O_RDONLY)
        try:
            if r.length < GATHER_BELOW:
                _write_gathered(src_fd, run, dst_fd, at)
            else:
                done = _copy_in_kernel(src_fd, dst_fd, r.offset, at, r.length)
                if done < r.length:
                    _copy_buffered(src_fd, dst_fd, r.offset + done, at + done, r.length - done)
        finally:
            os.close(src_fd)
        at, i = at + ranges_bytes(run), i + len(run)
    return at - dst_offset


def ranges_bytes(ranges: Sequence[ByteRange]) -> int:
    return sum(r.length for r in ranges)
