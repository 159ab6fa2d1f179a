"""Write a `torch.save` file one tensor at a time: the same bytes, the memory of a tensor or two.

`torch.save` needs every tensor of a file in memory at once and writes, then hashes, on one
thread. Here the state is first saved with placeholder tensors (`torch.empty`: never touched, so
never resident) under `torch.serialization.skip_data`, which writes the whole archive (pickle,
records, directory) with each storage's bytes reserved. Each real tensor is then written into
its record as soon as it is built (`os.pwrite`), or copied into it from the HF file without being
built (`copy_file_range`, toolkit/convert/range_copy.py), while a second thread hashes the file in
order behind the writes. The result is byte for byte what `torch.save` writes
(tests/test_convert_speed_paths.py compares them).
"""

from __future__ import annotations

import os
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import torch
import torch.utils.serialization

from toolkit.checksum import Hasher
from toolkit.convert.range_copy import copy_ranges, ranges_bytes, write_all


@contextmanager
def without_zip_crc32():
    """torch.save without the zip CRC32 (about 40% of its time; nothing checks it on load, and
    our checksum covers every file)."""
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
        self.f, self.digest = f, Hasher()

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


class RecordFiller:
    """Fills the reserved records of a file in file order, by copying byte ranges in the kernel
    or writing a built tensor, while a second thread hashes the file from start to end behind it,
    reading back what was placed (from the page cache: the bytes of a kernel copy never pass
    through this process otherwise; mapped, not copied: toolkit.checksum). The two overlap, so a file
    costs about the slower of them."""

    def __init__(self, fd: int, file_size: int):
        self.fd, self.file_size, self.placed = fd, file_size, 0
        self.digest, self._hashed = Hasher(), 0
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-hasher")
        self._pending: list[Future] = []

    def _hash_up_to(self, end: int) -> None:
        if end > self.file_size:
            raise RuntimeError(f"records up to byte {end} of a file of {self.file_size}")
        self.digest.update_from_file(self.fd, self._hashed, end)
        self._hashed = max(self._hashed, end)

    def place(self, item, offset: int, size: int) -> None:
        """`item`: a tensor of `size` bytes, or byte ranges (toolkit.convert.range_copy) adding up to it."""
        if offset < self.placed:
            raise RuntimeError(f"record at {offset} placed after one ending at {self.placed}")
        if isinstance(item, torch.Tensor):
            write_all(self.fd, _bytes_of(item), offset)
        elif copy_ranges(item, self.fd, offset) != size:
            raise RuntimeError(f"byte ranges of {ranges_bytes(item)} bytes for a record of {size}")
        self.placed = offset + size
        for finished in [f for f in self._pending if f.done()]:
            finished.result()  # a failed read surfaces now, not at the end
            self._pending.remove(finished)
        self._pending.append(self._hasher.submit(self._hash_up_to, self.placed))

    def finish(self) -> str:
        """The file's checksum (toolkit.checksum), once every byte is hashed."""
        try:
            self._pending.append(self._hasher.submit(self._hash_up_to, self.file_size))
            for f in self._pending:
                f.result()
        finally:
            self._hasher.shutdown()
        return self.digest.hexdigest()

    def abandon(self) -> None:
        self._hasher.shutdown(cancel_futures=True)


def _check_matches(item, placeholder: torch.Tensor, size: int, index: int) -> None:
    if not isinstance(item, torch.Tensor):
        return  # byte ranges: their length is checked as they are placed
    if item.shape != placeholder.shape or item.dtype != placeholder.dtype or not item.is_contiguous():
        raise RuntimeError(f"tensor {index}: built {tuple(item.shape)} {item.dtype}, but its record was laid out "
                           f"for {tuple(placeholder.shape)} {placeholder.dtype} (contiguous)")
    if item.nbytes != size:
        raise RuntimeError(f"tensor {index}: {item.nbytes} bytes for a record of {size}")


def fill_records(path: Path, records: Iterable[tuple[int, int, object]]) -> str:
    """Place each (offset, size, tensor or byte ranges) into the file at `path`, in file order;
    returns the file's checksum (toolkit.checksum)."""
    fd = os.open(path, os.O_RDWR)
    filler = RecordFiller(fd, os.fstat(fd).st_size)
    try:
        for offset, size, item in records:
            filler.place(item, offset, size)
            del item  # not held while the next is built
        return filler.finish()
    except BaseException:
        filler.abandon()
        raise
    finally:
        os.close(fd)


def save_streaming(state: dict, placeholders: list[torch.Tensor], items: Iterable, path: Path) -> str:
    """torch.save(state) to `path` where `state` holds `placeholders` (distinct `torch.empty` tensors,
    in the order the pickler meets them) and `items` yields their real values in that order, each
    a tensor or the byte ranges holding it (toolkit.convert.range_copy). Returns the file's checksum.
    Without the zip CRC32, as toolkit.convert.torch_format saves. Each item is placed before the
    next is asked for, and no reference to it is kept past that, so memory holds one at a time
    (an `enumerate` would hold the last one while the next is built)."""
    with open(path, "wb") as f, torch.serialization.skip_data(), without_zip_crc32():
        torch.save(state, f)
    spans = _record_spans(path, len(placeholders))

    def records():
        count = 0
        for item in items:
            if count >= len(placeholders):
                raise RuntimeError(f"more tensors than the {len(placeholders)} laid out")
            _check_matches(item, placeholders[count], spans[count][1], count)
            yield spans[count][0], spans[count][1], item
            del item  # before the next is built
            count += 1
        if count != len(placeholders):
            raise RuntimeError(f"{count} tensors built for {len(placeholders)} records")

    return fill_records(path, records())
