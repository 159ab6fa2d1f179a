"""Read the small text and JSON files of a checkpoint, turning every way they can be broken
(missing, a directory, unreadable, not UTF-8, not JSON, not an object) into one ConversionError
line that names the file."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import ConversionError


def read_file_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise ConversionError(f"{path} is missing or not a regular file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e.strerror}") from e


def decode_utf8(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path} is not valid UTF-8 (byte {e.start}): is it the right file?") from e


def read_utf8(path: Path) -> str:
    return decode_utf8(read_file_bytes(path), path)


def read_json_object(path: Path) -> dict:
    return parse_json_object(read_file_bytes(path), path)


def parse_json_object(raw: bytes, path: Path) -> dict:
    """The JSON object in `raw`, the bytes of `path` (read once by a caller that keeps them)."""
    try:
        data = json.loads(decode_utf8(raw, path))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): truncated or edited?") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data
