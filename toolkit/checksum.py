"""The checksums recorded for every file of a checkpoint: BLAKE3 for what we write, sha256 still read.

A recorded digest names its algorithm: `blake3:<64 hex>`. A bare 64-hex digest is sha256, as
every toolkit release before BLAKE3 recorded it, so those checkpoints still verify and export.
Both are cryptographic: a changed bit anywhere changes the digest. BLAKE3 is chosen for speed
(measured on one core here: sha256 1.9 GB/s with the CPU's SHA extensions, BLAKE3 7.2 GB/s on one
thread and 13 GB/s on its own threads), since hashing the output was the largest CPU cost of a
conversion after the copy itself. Files are hashed through read-only memory maps of a window at a
time: the bytes are hashed where the page cache holds them, not copied into a buffer first (at 3.5 GB:
0.5 s instead of 1.2 s, and 0.8 s of CPU instead of 1.4 s), and the mapped pages stay a window's.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from pathlib import Path

import blake3

ALGORITHM = "blake3"  # what new checksums use
_PREFIXED = re.compile(r"^(blake3|sha256):[0-9a-f]{64}$")
_LEGACY_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAP_BYTES = 64 << 20  # the window of a file mapped at a time while it is hashed


class Hasher:
    """Bytes in, a recorded digest out. BLAKE3 hashes large updates on its own threads (it releases
    the GIL), so a core left free by the writer is used."""

    def __init__(self, algorithm: str = ALGORITHM):
        self.algorithm = algorithm
        if algorithm == "blake3":
            self._digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
        elif algorithm == "sha256":
            self._digest = hashlib.sha256()
        else:
            raise ValueError(f"unknown checksum algorithm {algorithm!r} (blake3 or sha256)")

    def update(self, data) -> None:
        self._digest.update(data)

    def update_from_file(self, fd: int, start: int, end: int) -> None:
        """Hash bytes [start, end) of the open file `fd`, a mapped window at a time."""
        while start < end:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            length = min(end, base + MAP_BYTES) - base
            with mmap.mmap(fd, length, offset=base, access=mmap.ACCESS_READ) as window:
                view = memoryview(window)[start - base:]
                try:
                    self._digest.update(view)
                finally:
                    view.release()  # before the window is unmapped
            start = base + length

    def hexdigest(self) -> str:
        """The digest as recorded: sha256 bare, as releases before BLAKE3 recorded it, so that a
        checkpoint's checksums stay comparable with the ones it was written with."""
        if self.algorithm == "sha256":
            return self._digest.hexdigest()
        return f"{self.algorithm}:{self._digest.hexdigest()}"


def is_recorded_digest(value: object) -> bool:
    """A digest as this module records it, or a bare sha256 from an older release."""
    return isinstance(value, str) and bool(_PREFIXED.match(value) or _LEGACY_SHA256.match(value))


def algorithm_of(recorded: str) -> str:
    return recorded.split(":", 1)[0] if ":" in recorded else "sha256"


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """The digest of a file's bytes (mapped a window at a time: no anonymous memory for ckpt
    reshard's memory bound)."""
    hasher = Hasher(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher.update_from_file(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return hasher.hexdigest()


def matches(path: Path, recorded: str) -> bool:
    """Whether the file's bytes have the recorded digest, in the algorithm it was recorded with."""
    return file_digest(path, algorithm_of(recorded)) == recorded
