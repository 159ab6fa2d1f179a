"""The fine-tuning recipe with megatron-core's default p2p put back for the interleaved schedule
(`batch_p2p_comm=True`), for the guard test of tests/test_virtual_pipeline.py. Patched here, in
the worker, so the product has no test switch."""

import runpy
from pathlib import Path

from toolkit.train import virtual

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"
_settings = virtual.schedule_settings


def _batched(pp, vpp):
    return {**_settings(pp, vpp), "batch_p2p_comm": True}


if __name__ == "__main__":
    virtual.schedule_settings = _batched
    runpy.run_path(str(RECIPE), run_name="__main__")
