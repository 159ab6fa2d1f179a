"""Write a `torch.save` file one tensor at a time: the same bytes, the memory of a tensor or two.

`torch.save` needs every tensor of a file in memory at once and writes, then hashes, on one
thread. Here the state is first saved with placeholder tensors (`torch.empty`: never touched, so
never resident) under `torch.serialization.skip_data`, which writes the whole archive (pickle,
records, directory) with each storage's bytes reserved. Each real tensor is then written into
its record with `os.pwrite` as soon as it is built, by a writer thread that also hashes the file
in order, while the caller builds the next tensor. The result is byte for byte what `torch.save`
writes (tests/test_convert_speed_paths.py compares them).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import torch
import torch.utils.serialization

# Tensors built ahead of the writer: the builder may run this far in front (memory bound).
MAX_PENDING = 2


@contextmanager
def without_zip_crc32():
    """torch.save without the zip CRC32 (about 40% of its time; nothing checks it on load, and
    our sha256 covers every file)."""
    config = torch.utils.serialization.config.save
    saved, config.compute_crc32 = config.compute_crc32, False
    try:
        yield
    finally:
        config.compute_crc32 = saved


class HashingWriter:
    """A file wrapper that hashes bytes as they are written in order (torch.save and DCP's writer
    write sequentially), so a checksum costs no second read of the file."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name):  # close, fileno, ... of the wrapped file (a seek would be caught by the tests)
        return getattr(self.f, name)


def _record_spans(path: Path, count: int) -> list[tuple[int, int]]:
    """(offset, size) of the storage records data/0 .. data/count-1, in key order."""
    sizes = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            prefix, _, key = info.filename.partition("/data/")
            if key.isdigit() and "/" not in prefix:
                sizes[int(key)] = info.file_size
    if sorted(sizes) != list(range(count)):
        raise RuntimeError(f"{path}: expected storage records 0..{count - 1}, found {sorted(sizes)}")
    reader = torch._C.PyTorchFileReader(str(path))
    return [(reader.get_record_offset(f"data/{key}"), sizes[key]) for key in range(count)]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # Linux writes at most ~2 GiB per call
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _OrderedWriter:
    """Writes each tensor into its record and hashes the file from start to end on the way."""

    def __init__(self, fd: int, file_size: int):
        self.fd, self.file_size, self.position, self.digest = fd, file_size, 0, hashlib.sha256()

    def _hash_file_up_to(self, end: int) -> None:
        while self.position < end:  # archive headers between records: small, written by torch.save
            chunk = os.pread(self.fd, min(end - self.position, 1 << 20), self.position)
            if not chunk:
                raise RuntimeError("archive shorter than its records")
            self.digest.update(chunk)
            self.position += len(chunk)

    def write(self, tensor: torch.Tensor, offset: int) -> None:
        self._hash_file_up_to(offset)
        data = _bytes_of(tensor)
        _pwrite_all(self.fd, data, offset)
        self.digest.update(data)
        self.position = offset + len(data)

    def finish(self) -> str:
        self._hash_file_up_to(self.file_size)
        return self.digest.hexdigest()


def _check_matches(tensor: torch.Tensor, placeholder: torch.Tensor, index: int) -> None:
    if tensor.shape != placeholder.shape or tensor.dtype != placeholder.dtype or not tensor.is_contiguous():
        raise RuntimeError(f"tensor {index}: built {tuple(tensor.shape)} {tensor.dtype}, but its record was laid out "
                           f"for {tuple(placeholder.shape)} {placeholder.dtype} (contiguous)")


def save_streaming(state: dict, placeholders: list[torch.Tensor], tensors: Iterable[torch.Tensor], path: Path,
                   max_pending: int = MAX_PENDING) -> str:
    """torch.save(state) to `path` where `state` holds `placeholders` (distinct `torch.empty` tensors,
    in the order the pickler meets them) and `tensors` yields their real values in that order.
    Returns the file's sha256. Without the zip CRC32, as toolkit.convert.torch_format saves.
    `max_pending` 1: each tensor is written before the next is asked for, so memory holds one.
    No reference to a tensor is kept past its write (an `enumerate` would hold the last one while
    the next is built)."""
    with open(path, "wb") as f, torch.serialization.skip_data(), without_zip_crc32():
        torch.save(state, f)
    spans = _record_spans(path, len(placeholders))
    fd = os.open(path, os.O_RDWR)
    try:
        writer = _OrderedWriter(fd, os.fstat(fd).st_size)
        pending: list[Future] = []
        count = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-file-writer") as pool:
            for tensor in tensors:
                if count >= len(placeholders):
                    raise RuntimeError(f"more tensors than the {len(placeholders)} laid out")
                _check_matches(tensor, placeholders[count], count)
                if tensor.nbytes != spans[count][1]:
                    raise RuntimeError(f"tensor {count}: {tensor.nbytes} bytes for a record of {spans[count][1]}")
                pending.append(pool.submit(writer.write, tensor, spans[count][0]))
                del tensor  # the writer holds it until written
                count += 1
                while len(pending) >= max_pending:
                    pending.pop(0).result()
            for done in pending:
                done.result()
        if count != len(placeholders):
            raise RuntimeError(f"{count} tensors built for {len(placeholders)} records")
        return writer.finish()
    finally:
        os.close(fd)
