"""Run recipes/finetune.py in this process with timers installed, then write what they recorded
(the shell of benchmarks/moe_timed_recipe.py and benchmarks/bubble_timed_recipe.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def run_timed(argv: list[str], install: Callable[[], None], name: str, recorded: dict) -> int:
    """The recipe with `argv` after `install()`; each rank writes `recorded` to
    <run_dir>/<name>_rank<N>.json when the recipe returns."""
    sys.path.insert(0, str(REPO / "recipes"))
    import finetune

    install()
    run_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("run_dir="))
    rank = int(os.environ.get("RANK", 0))
    code = finetune.main(argv)
    (Path(run_dir) / f"{name}_rank{rank}.json").write_text(json.dumps(recorded))
    return code
