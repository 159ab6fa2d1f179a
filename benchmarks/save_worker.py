"""The fine-tuning recipe with every checkpoint save timed twice in the same run: once as the
checkpoint was before the layout-independent train/ state (DeepSpeed's own files, its ZeRO optimizer
files included, and model/; elastic.save_state skipped) and once as it is (train/ instead of
DeepSpeed's optimizer files), the order alternating from save to save so neither pays all of the
first-save costs. Rank 0 appends
{"step", "with_s", "without_s", "elastic_s"} and the
same in CPU seconds of rank 0 ("with_cpu_s", ...: less sensitive to other load on a shared machine) to $SAVE_BENCH_OUT. Used by save_bench.py."""

import json
import os
import runpy
import time
from pathlib import Path

import torch.distributed as dist

from toolkit.train import checkpoint, elastic

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"
_save, _save_state, _save_deepspeed = checkpoint.save, elastic.save_state, checkpoint._save_deepspeed
_elastic_seconds = []


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(began: tuple[float, float]) -> tuple[float, float]:
    now = _clocks()
    return now[0] - began[0], now[1] - began[1]


def _timed_save_state(*args, **kwargs):
    began = _clocks()
    _save_state(*args, **kwargs)
    _elastic_seconds.append(_since(began))


def _skip_save_state(*args, **kwargs):
    pass


def _save_deepspeed_with_optimizer_files(engine, directory, optimizer_files, exclude_frozen):
    _save_deepspeed(engine, directory, True, exclude_frozen)


def _one(with_state: bool, *args, **kwargs):
    os.sync()  # the previous save's dirty pages written back, as minutes between saves of a real run would
    elastic.save_state = _timed_save_state if with_state else _skip_save_state
    checkpoint._save_deepspeed = _save_deepspeed if with_state else _save_deepspeed_with_optimizer_files
    dist.barrier()
    began = _clocks()
    result = _save(*args, **kwargs)
    return _since(began), result


def timed_save(run_dir, step, *args, **kwargs):
    order = (True, False) if step % 2 else (False, True)
    seconds = {}
    for with_state in order:
        seconds[with_state], result = _one(with_state, run_dir, step, *args, **kwargs)
    if dist.get_rank() == 0:
        record = {"step": step}
        for clock, suffix in enumerate(("s", "cpu_s")):
            record.update({f"with_{suffix}": seconds[True][clock], f"without_{suffix}": seconds[False][clock],
                           f"elastic_{suffix}": _elastic_seconds[-1][clock]})
        with open(os.environ["SAVE_BENCH_OUT"], "a") as out:
            out.write(json.dumps(record) + "\n")
    return result


if __name__ == "__main__":
    checkpoint.save = timed_save
    runpy.run_path(str(RECIPE), run_name="__main__")
