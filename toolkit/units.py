"""Byte sizes as people write them: 80GiB, 80GB, 1.5TiB, 512M (binary for GiB/TiB and bare G/T)."""

from __future__ import annotations

import re

from toolkit.errors import ConfigError

_UNITS = {"b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if match and not unit:  # `--gpu-memory 80` meant 80 GiB, not 80 bytes
        raise ConfigError(f"{text!r} has no unit: write it as {match.group(1)}GiB (or GB, TiB, ...)")
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size (examples: 80GiB, 80GB, 2TiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def size(n: int) -> str:
    """Bytes in the unit that keeps the number below 1024: "0 B", "346.00 KiB", "1.50 GiB"."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _BINARY_UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.2f} {unit}"
