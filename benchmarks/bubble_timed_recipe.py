"""recipes/finetune.py with every micro-batch's forward and backward timed on every rank
(benchmarks/bubble_bench.py runs it under torchrun with the recipe's overrides).

Wrappers around megatron-core's `schedules.forward_step` and `schedules.backward_step` (what both
the 1F1B and the interleaved schedule call for each micro-batch and model chunk) record
(kind, stage, micro-batch, start, end) with time.perf_counter, a clock all processes of one
machine share; a wrapper around the schedule itself records each step's window. Each rank writes
<run_dir>/pipeline_trace_rank<N>.json when the recipe returns. Nothing here changes what is computed,
and a normal run never loads it."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timed_recipe import run_timed  # noqa: E402

TRACE = {"steps": [], "ops": []}  # steps: [start, end]; ops: [kind, stage, micro-batch, step, start, end]
_outputs: dict[int, tuple[int, int]] = {}  # id(forward output) -> (stage, micro-batch), for its backward
_count: dict[int, int] = {}  # stage -> forwards so far in this step


def _stage(chunk) -> int:
    """The chunk's stage in the PP x VPP pipeline (vp_stage x PP + pipeline rank)."""
    from megatron.core import parallel_state as ps

    vp = getattr(chunk, "vp_stage", None) or 0
    return vp * ps.get_pipeline_model_parallel_world_size() + ps.get_pipeline_model_parallel_rank()


def _first(tensor):
    return tensor[0] if isinstance(tensor, (list, tuple)) else tensor


def install() -> None:
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    forward, backward, choose = schedules.forward_step, schedules.backward_step, pipeline_parallel.get_forward_backward_func

    @functools.wraps(forward)
    def timed_forward(*args, **kwargs):
        stage = _stage(args[2])
        micro = _count.get(stage, 0)
        _count[stage] = micro + 1
        began = time.perf_counter()
        result = forward(*args, **kwargs)
        TRACE["ops"].append(["F", stage, micro, len(TRACE["steps"]), began, time.perf_counter()])
        _outputs[id(_first(result[0]))] = (stage, micro)
        return result

    @functools.wraps(backward)
    def timed_backward(input_tensor, output_tensor, *args, **kwargs):
        stage, micro = _outputs.pop(id(_first(output_tensor)))
        began = time.perf_counter()
        result = backward(input_tensor, output_tensor, *args, **kwargs)
        TRACE["ops"].append(["B", stage, micro, len(TRACE["steps"]), began, time.perf_counter()])
        return result

    def timed_choice():
        run = choose()

        def timed_schedule(*args, **kwargs):
            _count.clear()
            began = time.perf_counter()
            result = run(*args, **kwargs)
            if not kwargs.get("forward_only"):
                TRACE["steps"].append([began, time.perf_counter()])
            return result

        return timed_schedule

    schedules.forward_step, schedules.backward_step = timed_forward, timed_backward
    pipeline_parallel.get_forward_backward_func = timed_choice


def main(argv: list[str]) -> int:
    return run_timed(argv, install, "pipeline_trace", TRACE)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
