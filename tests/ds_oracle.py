"""DeepSpeed's own config parser, `deepspeed.runtime.config.DeepSpeedConfig`, as a test oracle.

Two traps make a naive oracle both accept wrong configs and reject right ones:

* DeepSpeedConfig reads the world size inside `try: dist.get_rank() ... except: world_size = 1`
  (runtime/config.py). Unless deepspeed.comm is initialised it ignores the mpu and checks the
  batch against 1. So the fixture below first joins a one-process gloo group (RANK=0,
  WORLD_SIZE=1) with deepspeed.init_distributed.
* With an mpu, the batch is checked against mpu.get_data_parallel_world_size(). A config for 64
  GPUs at TP=8 must be checked against DP=8, but this process is a world of one, so a real
  megatron-core mpu would report DP=1. `StandInMPU` therefore reports the target DP size, which
  is the only mpu method DeepSpeedConfig calls: it stands in for the cluster the config is for.
"""

from __future__ import annotations

import logging
import os

import pytest

from toolkit.runtime.launch import free_port


class StandInMPU:
    """Reports the data-parallel size of the target cluster (see the module docstring)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


class Oracle:
    def parse(self, config: dict | str, dp: int):
        """DeepSpeedConfig for `config` (a dict or a JSON file path) at data-parallel size `dp`;
        raises what DeepSpeed raises."""
        from deepspeed.runtime.config import DeepSpeedConfig

        return DeepSpeedConfig(dict(config) if isinstance(config, dict) else str(config), mpu=StandInMPU(dp))

    def accepts(self, config: dict | str, dp: int) -> bool:
        try:
            self.parse(config, dp)
        except Exception:  # noqa: BLE001 - any rejection counts
            return False
        return True

    def error(self, config: dict | str, dp: int) -> str | None:
        try:
            self.parse(config, dp)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None


def cpu_accelerator_in_this_process() -> None:
    """DeepSpeed's CPU accelerator for this (pytest) process only. DeepSpeed picks its accelerator
    once, at the first get_accelerator(), from DS_ACCELERATOR; the variable is then put back as it
    was, so that the fine-tunes later tests launch don't inherit it: on a GPU machine, DeepSpeed
    would move their models to the CPU (tests/conftest.py fails a collection that leaves it changed)."""
    from toolkit.runtime.distributed import deepspeed_cpu_accelerator

    with deepspeed_cpu_accelerator():
        from deepspeed.accelerator import get_accelerator

        get_accelerator()


@pytest.fixture(scope="session")
def oracle():
    cpu_accelerator_in_this_process()
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger

    from toolkit.runtime.cpu_compat import skip_deepspeed_shm_op

    logger.setLevel(logging.ERROR)
    owned = not dist.is_initialized()
    if owned:
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        skip_deepspeed_shm_op()
        deepspeed.init_distributed(dist_backend="gloo")
        _restore(saved)
    assert deepspeed.comm.get_world_size() == 1
    yield Oracle()
    if owned:
        dist.destroy_process_group()


def _restore(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
