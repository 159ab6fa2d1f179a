"""recipes/finetune.py with the alltoall token dispatcher timed (benchmarks/moe_bench.py runs it
under torchrun with the recipe's overrides). Timers wrap megatron-core's dispatcher methods (the
router's permutation, the all-to-alls, the sort by local expert, and their inverses in combine)
and the backward of its all-to-all; each rank writes its seconds to
<run_dir>/dispatcher_rank<N>.json when the recipe returns. Nothing here changes what is computed."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timed_recipe import run_timed  # noqa: E402

METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
           "combine_preprocess", "token_combine", "combine_postprocess")
SECONDS = {"forward": 0.0, "backward": 0.0, "calls": 0}


def _timed(fn, key: str):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - began
            SECONDS["calls"] += 1

    return run


def install() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    for name in METHODS:
        setattr(MoEAlltoAllTokenDispatcher, name, _timed(getattr(MoEAlltoAllTokenDispatcher, name), "forward"))
    mappings._AllToAll.backward = staticmethod(_timed(mappings._AllToAll.backward, "backward"))


def main(argv: list[str]) -> int:
    return run_timed(argv, install, "dispatcher", SECONDS)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
