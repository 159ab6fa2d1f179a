"""The fine-tuning recipe with one defect put in on purpose, for guard tests: parameters whose name
contains LEFT_OUT_OF_TP_SUM (every one when it is empty) are left out of the TP sum of partial
gradients (toolkit.train.parallel.partial_over_tp), so each TP rank keeps the gradient of its own
tokens (sequence-parallel norms, routers) or heads (q/k norms). "" is a dropped TP sum of the norms'
gradients (tests/test_finetune_parity.py's bf16 guard); ".router." a small router-gradient bug, as
a router weight that lost its `sequence_parallel` tag would have (tests/test_moe_finetune.py).
Patched here, in the worker, so the product has no test switch."""

import os
import runpy
from pathlib import Path

from toolkit.train import parallel

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"
_partial_over_tp = parallel.partial_over_tp


def _left_out(config, name: str, param) -> bool:
    return os.environ["LEFT_OUT_OF_TP_SUM"] not in name and _partial_over_tp(config, name, param)


if __name__ == "__main__":
    parallel.partial_over_tp = _left_out
    runpy.run_path(str(RECIPE), run_name="__main__")
