"""Copy a shard's bytes file to file, without building the tensor in memory.

Where a split kind describes a shard as row pieces of HF tensors (toolkit.splits.kinds.RowPiece), the
shard is a list of byte ranges of the safetensors files. No dtype cast happens on conversion, so
the bytes are the tensor's bytes. Each range is copied one of two ways:

* a large one (a column-parallel shard, a whole tensor) by the kernel with `copy_file_range`: no
  pass through user space and no mapping of the source;
* small ones (a row-parallel shard is one column slice per row) gathered: up to IOV_MAX of them in
  one `pwritev` from a read-only map of the source file, so the bytes are copied once, page cache
  to page cache, as `cp` copies them. Building the shard as a tensor first (strided copy into fresh
  memory, then `write()`) took twice the CPU for the same bytes.

Where `copy_file_range` is refused (another file system, an old kernel: EXDEV, ENOSYS, ...),
the large ranges are copied with pread/pwrite through a bounded buffer instead.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from pathlib import Path
from typing import NamedTuple, Sequence

from toolkit.splits.kinds import Geometry, RowPiece, SplitKind, build_shard

# Below MIN_KERNEL_COPY_BYTES, a range is one of many (a row-parallel split copies each row's column
# slice), and a system call per range costs more than it saves (16 us per 8 KiB copy_file_range
# here: 0.5 GB/s; 64 KiB: ~2 GB/s): such ranges are gathered from a map, a pwritev per IOV_MAX of them
# (measured for 0.5 GiB in 2 KiB slices: 0.5 s of CPU, against 1.1-1.4 s to build the tensor and
# write it; 8 KiB slices 0.17-0.2 s against 0.5-0.8 s). Below MIN_RANGE_BYTES the Python object per
# slice costs as much as the strided copy it saves (512 B slices: about even), and the shard is built.
MIN_KERNEL_COPY_BYTES = 64 << 10
MIN_RANGE_BYTES = 1 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # POSIX's least
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


def _same_file(a: ByteRange, b: ByteRange) -> bool:
    return a.file is b.file or a.file == b.file  # the same Path object, mostly: its __eq__ is slow per row


def _piece_ranges(src, piece: RowPiece, row_bytes: int) -> list[ByteRange]:
    if piece.name is None:
        return [ByteRange(None, 0, (piece.stop - piece.start) * row_bytes)]
    entry = src.tensors[piece.name]
    row_bytes = math.prod(entry.shape[1:]) * entry.itemsize
    if piece.cols is None or (piece.cols.start, piece.cols.stop) == (0, entry.shape[1]):  # whole rows: one range
        return [ByteRange(entry.file, entry.offset + piece.start * row_bytes, (piece.stop - piece.start) * row_bytes)]
    first, width = piece.cols.start * entry.itemsize, (piece.cols.stop - piece.cols.start) * entry.itemsize
    return [ByteRange(entry.file, entry.offset + r * row_bytes + first, width) for r in range(piece.start, piece.stop)]


def _merged(ranges: list[ByteRange]) -> list[ByteRange]:
    out: list[ByteRange] = []
    for r in ranges:
        if r.length == 0:
            continue
        last = out[-1] if out else None
        if last and _same_file(last, r) and (r.file is None or last.offset + last.length == r.offset):
            out[-1] = last._replace(length=last.length + r.length)
        else:
            out.append(r)
    return out


def shard_ranges(split: SplitKind, src, names: Sequence[str], tp: int, rank: int, geo: Geometry) -> list[ByteRange] | None:
    """The bytes of build_shard(split, src, names, tp, rank, geo) as ranges of the HF files, or
    None where the split kind does not describe them or a range would be small."""
    pieces = split.row_pieces(src, names, tp, rank, geo)
    if pieces is None or any(p.name is not None and (src.tensors[p.name].file is None or src.tensors[p.name].stored)
                             for p in pieces):
        # a tensor with no bytes of its own in a file (toolkit/convert/fused_experts.py), or converted on
        # reading (FP8 dequantized, toolkit/convert/fp8.py): built, never byte-copied
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


def _copy_one(r: ByteRange, dst_fd: int, at: int) -> None:
    src_fd = os.open(r.file, os.O_RDONLY)
    try:
        done = _copy_in_kernel(src_fd, dst_fd, r.offset, at, r.length)
        if done < r.length:
            _copy_buffered(src_fd, dst_fd, r.offset + done, at + done, r.length - done)
    finally:
        os.close(src_fd)


def _gather(batch: Sequence[ByteRange], dst_fd: int, at: int) -> None:
    """Write the ranges of one file (at most IOV_MAX), one after the other, with one pwritev from
    a read-only map of the span that holds them."""
    start = min(r.offset for r in batch)
    base = start - start % mmap.ALLOCATIONGRANULARITY
    end = max(r.offset + r.length for r in batch)
    src_fd = os.open(batch[0].file, os.O_RDONLY)
    try:
        if os.fstat(src_fd).st_size < end:
            raise OSError(errno.EIO, f"{batch[0].file}: source ended {end - os.fstat(src_fd).st_size} bytes early")
        with mmap.mmap(src_fd, end - base, offset=base, access=mmap.ACCESS_READ) as window:
            whole = memoryview(window)
            pieces = [whole[r.offset - base: r.offset - base + r.length] for r in batch]
            try:
                written = os.pwritev(dst_fd, pieces, at)
                for piece in pieces:  # a pwritev may write less than asked: the rest one by one
                    if written >= len(piece):
                        written -= len(piece)
                    else:
                        write_all(dst_fd, piece[written:], at + written)
                        written = 0
                    at += len(piece)
            finally:
                for piece in pieces:
                    piece.release()  # before the window is unmapped
                whole.release()
    finally:
        os.close(src_fd)


def copy_ranges(ranges: Sequence[ByteRange], dst_fd: int, dst_offset: int) -> int:
    """Copy the ranges, one after the other, to dst_fd at dst_offset; returns the bytes written."""
    at = dst_offset
    batch: list[ByteRange] = []  # small ranges of one file, gathered together
    for r in [*ranges, None]:
        if batch and (r is None or not _same_file(r, batch[0]) or r.length >= MIN_KERNEL_COPY_BYTES
                      or len(batch) == _IOV_MAX):
            _gather(batch, dst_fd, at)
            at += ranges_bytes(batch)
            batch = []
        if r is None:
            break
        if r.file is None:
            _write_zeros(dst_fd, at, r.length)
            at += r.length
        elif r.length >= MIN_KERNEL_COPY_BYTES:
            _copy_one(r, dst_fd, at)
            at += r.length
        else:
            batch.append(r)
    return at - dst_offset


def ranges_bytes(ranges: Sequence[ByteRange]) -> int:
    return sum(r.length for r in ranges)
