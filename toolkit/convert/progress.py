"""Progress for long conversions and checks: tqdm bars (shown on a terminal, silent in logs and
tests) and numbered stage lines for work that has no natural count."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@contextmanager
def progress_bar(total: int, desc: str, enabled: bool | None = None):
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    with tqdm(total=total, desc=desc, unit="tensor", disable=not show, leave=False) as bar:
        yield bar


@dataclass(frozen=True)
class Stages:
    """`name [i/N] what  (+s)` lines on stderr. Picklable, so worker processes report on the same
    clock; only rank 0 of a launch prints (`rank` argument)."""

    name: str
    total: int
    enabled: bool = True
    started: float = field(default_factory=time.time)

    def __call__(self, index: int, what: str, rank: int = 0) -> None:
        if self.enabled and rank == 0:
            print(f"{self.name} [{index}/{self.total}] {what}  (+{time.time() - self.started:.1f} s)",
                  file=sys.stderr, flush=True)
