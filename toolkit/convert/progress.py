"""Progress bars for long conversions: shown on a terminal, silent in logs and tests."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, desc: str, enabled: bool | None = None):
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    with tqdm(total=total, desc=desc, unit="tensor", disable=not show, leave=False) as bar:
        yield bar
