"""Per-op CPU profile of training steps, for benchmarks/finetune_bench.py.

    torchrun ... benchmarks/step_profile.py PROFILE_OUT [recipe overrides ...]

runs recipes/finetune.py with torch.profiler around steps FIRST..FIRST+COUNT-1 of rank 0 and
writes the per-op table (self CPU time) to PROFILE_OUT. `profiled(fn, ...)` does the same for
any step function (the HF + DeepSpeed baseline). Nothing here changes what is computed.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST, COUNT = 4, 3  # after warm-up (first-step allocations, DeepSpeed's lazy set-up)
TOP_OPS = 18


def op_table(prof, top: int = TOP_OPS) -> str:
    """The `top` ops by self CPU time, with their share of the profiled time."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = [f"{'op':<58} {'calls':>6} {'self ms':>9} {'share':>6}"]
    for e in events[:top]:
        lines.append(f"{e.key[:58]:<58} {e.count:>6} {e.self_cpu_time_total / 1e3:9.1f} {e.self_cpu_time_total / total:6.1%}")
    lines.append(f"{'all ops':<58} {'':>6} {total / 1e3:9.1f}")
    return "\n".join(lines)


def profiled(step_fn, out: Path, first: int = FIRST, count: int = COUNT):
    """Wrap step_fn: its calls first..first+count-1 (1-based) run under torch.profiler on rank 0,
    and the op table is written to `out` after the last of them."""
    import torch.profiler

    if int(os.environ.get("RANK", "0")) != 0:
        return step_fn
    calls = {"n": 0, "prof": None}

    @functools.wraps(step_fn)
    def step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == first:
            calls["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            calls["prof"].__enter__()
        try:
            return step_fn(*args, **kwargs)
        finally:
            if calls["n"] == first + count - 1:
                calls["prof"].__exit__(None, None, None)
                out.write_text(op_table(calls["prof"]) + "\n")

    return step


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO / "recipes"))
    import finetune

    from toolkit.train import step as step_module

    out, overrides = Path(argv[0]), argv[1:]
    # finetune.py imports train_step from the module when it runs, so patching the module suffices.
    step_module.train_step = profiled(step_module.train_step, out)
    return finetune.main(overrides)


if __name__ == "__main__":  # a torchrun-launched script needs the guard (dist-checkpoint saves)
    raise SystemExit(main(sys.argv[1:]))
