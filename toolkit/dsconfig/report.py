"""What `check` finds: problems with a stable kind, the key path, and an actionable message."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    kind: str  # stable identifier, e.g. "unknown-key"; tests and scripts match on it
    path: str  # dotted key path, "" for the config as a whole
    message: str
    severity: str = ERROR

    def line(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.severity}: {where}{self.message} [{self.kind}]"


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, kind: str, path: str, message: str, severity: str = ERROR) -> None:
        self.problems.append(Problem(kind, path, message, severity))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == ERROR]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def lines(self) -> list[str]:
        out = [p.line() for p in self.errors + self.warnings] + [f"note: {n}" for n in self.notes]
        verdict = "OK" if self.ok else f"{len(self.errors)} error(s)"
        return out + [f"{verdict}, {len(self.warnings)} warning(s)"]


def did_you_mean(key: str, candidates) -> str:
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.7)
    return f"; did you mean '{match[0]}'?" if match else ""


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def as_number(text: str) -> int | float | None:
    """The number a string spells ("5e8" -> 500000000), or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else value
