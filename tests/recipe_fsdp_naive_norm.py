"""The fine-tuning recipe with one defect put in on purpose, for the FSDP guard test: the gradient
norm as torch's clip_grad_norm_ computes it over the DTensor gradients, which reduces over their
(DP) mesh only: each TP rank sees the norm of its own TP shard. Patched here, in the worker, so
the product has no test switch."""

import runpy
from pathlib import Path

import torch

from toolkit.train import fsdp

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"


def _norm_over_dp_only(self, model):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).full_tensor().double()


if __name__ == "__main__":
    fsdp.TensorParallelGrads.norm = _norm_over_dp_only
    runpy.run_path(str(RECIPE), run_name="__main__")
