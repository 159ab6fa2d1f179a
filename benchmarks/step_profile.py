"""Per-op profile of training steps (self time on the GPU where there is one, else on the CPU),
for benchmarks/finetune_bench.py.

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
    """The `top` ops by self time on the GPU where kernels ran (else on the CPU), with their share of
    the profiled time."""
    averages = prof.key_averages()
    on_gpu = any(getattr(e, "self_device_time_total", 0) > 0 for e in averages)

    def self_time(e) -> float:
        return e.self_device_time_total if on_gpu else e.self_cpu_time_total

    events = [e for e in averages if self_time(e) > 0]
    total = sum(self_time(e) for e in events) or 1
    events.sort(key=self_time, reverse=True)
    lines = [f"{'op':<58} {'calls':>6} {'self GPU ms' if on_gpu else 'self ms':>11} {'share':>6}"]
    for e in events[:top]:
        lines.append(f"{e.key[:58]:<58} {e.count:>6} {self_time(e) / 1e3:11.1f} {self_time(e) / total:6.1%}")
    lines.append(f"{'all ops':<58} {'':>6} {total / 1e3:11.1f}")
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
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            calls["prof"] = torch.profiler.profile(activities=activities)
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
