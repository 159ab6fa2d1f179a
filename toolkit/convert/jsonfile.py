"""Read the small text and JSON files of a checkpoint, turning every way they can be broken
(missing, a directory, unreadable, not UTF-8, not JSON, not an object) into one ConversionError
line that names the file."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import ConversionError


def read_utf8(path: Path) -> str:
    if not path.is_file():
        raise ConversionError(f"{path} is missing or not a regular file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path} is not valid UTF-8 (byte {e.start}): is it the right file?") from e
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e.strerror}") from e


def read_json_object(path: Path) -> dict:
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): truncated or edited?") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data
