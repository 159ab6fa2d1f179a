"""What a numeric setting accepts, declared once and checked by one function.

DeepSpeed settings (dsconfig/settings.py) declare their bounds as field metadata (`bounded(...)`);
`ds-config check` applies the same Bound objects to the matching keys of a DeepSpeed JSON
(VALUE_BOUNDS); the fine-tuning recipe's typed fields carry them as `Annotated[int, Bound(...)]`
(train/config.py). NaN, inf, a
fraction where a count is meant and out-of-range values fail here with one line, instead of in
the optimizer's constructor or silently at the first step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    integer: bool = False  # a Python int (settings)
    whole: bool = False  # an integral number, 1000 or 1e3 (JSON, where 1e9 is written for counts)
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    lt: float | None = None  # value < lt
    le: float | None = None  # value <= le
    length: int | None = None  # a list of this many numbers, each within the bounds
    optional: bool = False  # None allowed

    def problem(self, name: str, value) -> str | None:
        """None if `value` is allowed, else "NAME must be ... (got VALUE)"."""
        if value is None and self.optional:
            return None
        if self.length is not None:
            ok = isinstance(value, (list, tuple)) and len(value) == self.length and all(map(self.allows, value))
        else:
            ok = self.allows(value)
        return None if ok else f"{name} must be {self.describe()} (got {value!r})"

    def allows(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and not isinstance(value, int) or self.whole and not float(value).is_integer():
            return False
        limits = ((self.ge, value.__ge__), (self.gt, value.__gt__), (self.lt, value.__lt__), (self.le, value.__le__))
        return all(limit is None or test(limit) for limit, test in limits)

    def describe(self) -> str:
        kind = "an integer" if self.integer or self.whole else "a finite number"
        if self.length is not None:
            kind = f"{self.length} numbers"
        ranges = [f"{op} {limit!r}" for op, limit in ((">=", self.ge), (">", self.gt), ("<", self.lt),
                                                           ("<=", self.le)) if limit is not None]
        return " ".join([kind, " and ".join(ranges)]).strip()


def bounded(default=dataclasses.MISSING, **bound):
    """A dataclass field with a Bound; `first_problem` enforces it."""
    return dataclasses.field(default=default, metadata={"bound": Bound(**bound)})


def first_problem(settings) -> str | None:
    """The first field of the dataclass `settings` outside its Bound, as one line."""
    for f in dataclasses.fields(settings):
        bound = f.metadata.get("bound")
        problem = bound and bound.problem(f.name, getattr(settings, f.name))
        if problem:
            return problem
    return None


# Keys of a DeepSpeed JSON and what they accept (batch keys: see semantics._batch; warmup steps:
# optimizers._warmup_steps).
VALUE_BOUNDS = {
    "gradient_clipping": Bound(ge=0),
    "optimizer.params.lr": Bound(ge=0),
    "optimizer.params.betas": Bound(ge=0, lt=1, length=2),
    "optimizer.params.eps": Bound(ge=0),
    "optimizer.params.weight_decay": Bound(ge=0),
    "scheduler.params.total_num_steps": Bound(whole=True, ge=1),
    "scheduler.params.warmup_min_lr": Bound(ge=0),
    "scheduler.params.warmup_max_lr": Bound(ge=0),
}

