"""The fine-tuning recipe with one defect put in on purpose, for the elastic guard test: an
elastic resume loads the fp32 master weights but leaves Adam's moments at the zeros
`elastic.load_state` creates them with. Patched here, in the worker, so the product has no
test switch."""

import runpy
from pathlib import Path

from toolkit.train import elastic

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"

MOMENTS = {key for _, key in elastic.STATES if key is not None}
_set_fragment = elastic._set_fragment


def _set_fragment_without_moments(param, value, key):
    if key not in MOMENTS:
        _set_fragment(param, value, key)


if __name__ == "__main__":
    elastic._set_fragment = _set_fragment_without_moments
    runpy.run_path(str(RECIPE), run_name="__main__")
