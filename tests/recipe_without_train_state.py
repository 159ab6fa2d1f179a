"""The fine-tuning recipe without the layout-independent train/ state, for the MoE guard test: with
the experts' gradients deliberately reduced over all of DP, ZeRO partitions each expert over ranks
that hold different experts, so no consistent global state exists to write (megatron-core's
sharding check refuses it). The guard needs only model/ and the export. Patched here, in the
worker, so the product has no test switch for it."""

import runpy
from pathlib import Path

from toolkit.train import elastic

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"

if __name__ == "__main__":
    elastic.save_state = lambda *args, **kwargs: None
    runpy.run_path(str(RECIPE), run_name="__main__")
