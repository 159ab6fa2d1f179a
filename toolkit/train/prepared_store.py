"""A prepared data set on disk: one source's tokenized samples as flat arrays every rank maps.

A directory (named by toolkit.train.prepared_key) holds

  tokens.bin     uint32   every sample's token ids, one after another
  loss_mask.bin  uint8    1 where the token is a target, aligned with tokens.bin
  offsets.bin    int64    the index: sample i is tokens[offsets[i]:offsets[i + 1]] (samples + 1 entries)
  targets.bin    int32    each sample's trained-token count (sum(loss_mask[1:])), so that a global
                          batch's loss normaliser needs no token read
  meta.json      the key's fields, the read's counts (toolkit.train.data.DataStats, from which every
                 data refusal is decided again at each start), each array's dtype, length, size
                 and BLAKE3 digest

For method=dpo a sample is a sequence and pair i is samples 2i (chosen) and 2i + 1 (rejected).

Raw little-endian arrays mapped with numpy.memmap rather than Arrow: the rows are read by index,
a few at a time, as plain integers, which is a slice of a mapped array; a file's size says
whether it is whole (length x item size); and the writer streams chunks in with `write`, with no
schema, record batches or a library writer between the tokenizer and the page cache. Arrow would
add a dependency on its IPC layout for what is four flat columns.

The directory appears under its name only when complete (toolkit.atomic.atomic_directory: written
as .NAME.partial-PID and renamed), meta.json written last. Opening checks what is cheap, always:
meta.json parses, has this format and the key its name says, every array's file has the recorded
size, and the index's ends agree with the token count. The full BLAKE3 of every array is checked
when asked (data.verify_prepared=true, `toolkit data inspect --verify`); the writer hashes what it
wrote before the rename. A check that fails is a DamagedStore naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toolkit.checksum import file_digest
from toolkit.train.data import DataStats, Sample
from toolkit.train.data_sources import DataError
from toolkit.train.prepared_key import FORMAT

META = "meta.json"
DTYPES = {"tokens": np.uint32, "loss_mask": np.uint8, "offsets": np.int64, "targets": np.int32}


class DamagedStore(DataError):
    """A prepared directory that is not what its meta.json says (truncated, changed, half-written)."""


def array_file(name: str) -> str:
    return f"{name}.bin"


class StoreWriter:
    """Appends samples to the arrays of a new prepared directory, chunk by chunk."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = {name: open(directory / array_file(name), "wb") for name in DTYPES}
        self.sequences = self.token_count = 0
        self.files["offsets"].write(np.zeros(1, dtype=np.int64).tobytes())

    def append(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, targets: np.ndarray) -> None:
        self.files["tokens"].write(tokens.astype(DTYPES["tokens"], copy=False).tobytes())
        self.files["loss_mask"].write(loss_mask.astype(DTYPES["loss_mask"], copy=False).tobytes())
        ends = self.token_count + np.cumsum(lengths, dtype=np.int64)
        self.files["offsets"].write(ends.tobytes())
        self.files["targets"].write(targets.astype(DTYPES["targets"], copy=False).tobytes())
        self.sequences += len(lengths)
        self.token_count += int(lengths.sum())

    def bytes_written(self) -> int:
        return sum(f.tell() for f in self.files.values())

    def finish(self, fields: dict, method: str, stats: DataStats, seconds: float) -> dict:
        """Flush and fsync the arrays, hash them, write meta.json last; returns the meta."""
        counts = {"tokens": self.token_count, "loss_mask": self.token_count, "offsets": self.sequences + 1,
                  "targets": self.sequences}
        arrays = {}
        for name, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            path = self.directory / array_file(name)
            arrays[name] = {"dtype": np.dtype(DTYPES[name]).name, "count": counts[name], "bytes": path.stat().st_size,
                            "blake3": file_digest(path)}
        meta = {"format": FORMAT, "fields": fields, "method": method, "sequences": self.sequences,
                "stored_tokens": self.token_count, "stats": dict(stats.__dict__), "arrays": arrays,
                "prepare_seconds": round(seconds, 3)}
        with open(self.directory / META, "w") as f:
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        return meta

    def close(self) -> None:
        for f in self.files.values():
            f.close()


@dataclass
class SampleStore:
    """A prepared directory's samples, mapped read-only: indexing reads one sample's pages only."""

    directory: Path
    meta: dict
    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray
    _lengths: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def open(cls, directory: Path, verify: bool = False) -> "SampleStore":
        directory = Path(directory)
        meta = read_meta(directory)
        arrays = {}
        for name, dtype in DTYPES.items():
            arrays[name] = _map(directory, name, dtype, meta["arrays"].get(name))
        if verify:
            check_digests(directory, meta)
        store = cls(directory, meta, **arrays)
        if int(store.offsets[0]) != 0 or int(store.offsets[-1]) != len(store.tokens):
            raise DamagedStore(f"prepared data {directory} is damaged: its index ({array_file('offsets')}) does not "
                               f"span {array_file('tokens')}")
        return store

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(self.tokens[a:b].tolist(), self.loss_mask[a:b].tolist())

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's token count (in memory: 8 bytes a sample, none a token)."""
        if self._lengths is None:
            self._lengths = np.diff(self.offsets)
        return self._lengths

    def stats(self) -> DataStats:
        return DataStats(**self.meta["stats"])


def read_meta(directory: Path) -> dict:
    path = directory / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedStore(f"prepared data {directory} is damaged: it has no {META}") from None
    except (OSError, ValueError) as e:
        raise DamagedStore(f"prepared data {directory} is damaged: its {META} cannot be read ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("arrays"), dict):
        raise DamagedStore(f"prepared data {directory} is damaged: its {META} is not of format {FORMAT}")
    from toolkit.train.prepared_key import directory_name

    if directory_name(meta["fields"]) != directory.name:
        raise DamagedStore(f"prepared data {directory} is damaged: its {META} describes another key "
                           f"({directory_name(meta['fields'])})")
    return meta


def _map(directory: Path, name: str, dtype, recorded: dict | None) -> np.ndarray:
    path = directory / array_file(name)
    if recorded is None:
        raise DamagedStore(f"prepared data {directory} is damaged: its {META} records no {path.name}")
    expected = int(recorded["count"]) * np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedStore(f"prepared data {directory} is damaged: {path.name} is missing") from None
    if size != expected or size != int(recorded["bytes"]):
        raise DamagedStore(f"prepared data {directory} is damaged: {path.name} is {size} bytes, {META} records "
                           f"{expected}")
    if not expected:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(int(recorded["count"]),))


def check_digests(directory: Path, meta: dict) -> None:
    """Every array's BLAKE3 against meta.json (reads every byte)."""
    for name in DTYPES:
        recorded = meta["arrays"][name]["blake3"]
        if file_digest(directory / array_file(name)) != recorded:
            raise DamagedStore(f"prepared data {directory} is damaged: {array_file(name)} does not have the BLAKE3 "
                               f"digest its {META} records")
