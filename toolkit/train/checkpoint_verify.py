"""Is a checkpoint's every file a resume reads intact? Checked before any process starts, so that
`resume=auto` falls back to the newest checkpoint that is, with a line saying so, instead of a
PytorchStreamReader error on every rank.

What is read without loading tensors: train_state.json parses; each torch file (ranks/, ds/) is a
zip archive whose central directory reads and whose members lie inside the file, and small ones
(rank states) pass their CRCs; the torch_dist index of train/ and the byte ranges it points to
(toolkit.train.elastic.check_files); the adapter's safetensors header and size. What the check read
(train_state.json, train/'s index) comes back with it in an `Intact`, which the resume's checks use:
nothing of it is read twice.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError

CRC_CHECKED_BYTES = 64 << 20  # torch files up to this size are read whole (rank states); larger ones by their index
SAFETENSORS_HEADER = 8  # bytes of the little-endian header length that opens a safetensors file


@dataclass(frozen=True)
class Intact:
    """A checkpoint whose every file checked is sound, with what the check read."""

    path: Path
    state: dict  # train_state.json
    # train/'s reader (toolkit.convert.dist_format.IndexedReader), its index read; None: no train/
    train_index: object | None


class Damaged(ToolkitError):
    """The first damaged file of a checkpoint, and why."""


def intact(path: Path) -> Intact:
    """Checkpoint `path` checked; Damaged names its first damaged file."""
    path = Path(path)
    state = _train_state(path)
    problem = _torch_files(path)
    if problem:
        raise Damaged(problem)
    train_index = _elastic(path)
    problem = _adapter(path)
    if problem:
        raise Damaged(problem)
    return Intact(path, state, train_index)


def damage(path: Path) -> str | None:
    """The first damaged file of checkpoint `path` and why, or None when every file checked is sound."""
    try:
        intact(path)
    except Damaged as e:
        return str(e)
    return None


def _train_state(path: Path) -> dict:
    state = path / "train_state.json"
    try:
        parsed = json.loads(state.read_bytes().decode("utf-8"))
        int(parsed["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Damaged(f"{state} is unreadable ({type(e).__name__})") from None
    return parsed


def _torch_files(path: Path) -> str | None:
    for file in sorted([*path.glob("ranks/*.pt"), *path.glob("ds/*.pt")]):
        problem = _torch_zip(file)
        if problem:
            return f"{file} {problem}"
    return None


def _torch_zip(file: Path) -> str | None:
    """torch.save writes a zip archive: a truncated or overwritten one has no central directory
    (PytorchStreamReader's 'failed finding central directory'), or members past its end."""
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"is truncated ({size} bytes; {info.filename} needs more)"
            if size <= CRC_CHECKED_BYTES:
                bad = archive.testzip()
                if bad:
                    return f"is damaged ({bad} fails its CRC)"
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"is not a readable torch file ({e})"
    return None


def _elastic(path: Path):
    from toolkit.train import elastic

    if not (path / elastic.STATE_DIR).is_dir():
        return None
    try:
        return elastic.check_files(path / elastic.STATE_DIR)
    except ToolkitError as e:
        raise Damaged(str(e)) from None


def _adapter(path: Path) -> str | None:
    from toolkit.lora.peft_dir import WEIGHTS

    weights = path / "adapter" / WEIGHTS
    if not (path / "adapter").is_dir():
        return None
    try:
        raw = weights.read_bytes()
        (length,) = struct.unpack("<Q", raw[:SAFETENSORS_HEADER])
        header = json.loads(raw[SAFETENSORS_HEADER:SAFETENSORS_HEADER + length])
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
        return f"{weights} is unreadable ({type(e).__name__})"
    if len(raw) < SAFETENSORS_HEADER + length + end:
        return f"{weights} is truncated ({len(raw)} bytes of {SAFETENSORS_HEADER + length + end})"
    return None
