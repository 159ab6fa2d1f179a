"""A checkpoint written by megatron-core's own trainer objects (DistributedDataParallel with its
DistributedOptimizer, dist_checkpointing.save, as Megatron-LM saves torch_dist) read by our tools."""

from __future__ import annotations

import pytest
import torch

from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.dist_format import read_box, tensor_shapes
from toolkit.convert.megatron_checkpoint import OPTIMIZER_PREFIX, VOCAB_KEYS, resolve_iteration_dir
from toolkit.runtime.launch import run_on_processes
from toolkit.tinymodels import make_tiny_model

VOCAB = 250  # padded to 256 rows in both checkpoints; an export drops the padding rows


def whole(directory, key: str, shape, dtype) -> torch.Tensor:
    return read_box(directory, key, (0,) * len(shape), shape, dtype)


@pytest.mark.multiprocess
def test_megatron_core_distributed_optimizer_checkpoint_exports_its_exact_weights(tmp_path):
    """2 ranks (DP2) of megatron-core DDP + DistributedOptimizer, 3 Adam steps, saved with its
    optimizer state; `megatron-to-hf` exports it; converted back, every model tensor is the one
    megatron-core saved, bit for bit (and training moved it away from the starting weights)."""
    hf = make_tiny_model("llama-odd-vocab", tmp_path / "hf", dtype="float32", num_hidden_layers=4, vocab_size=VOCAB)
    start = hf_to_megatron(hf, tmp_path / "start", fmt="torch_dist", progress=False)
    saved = tmp_path / "megatron"
    losses = run_on_processes("tests.mp_workers:megatron_distributed_optimizer_checkpoint", 2, str(start), str(saved), 3)
    assert all(loss == loss for loss in losses)
    stored = tensor_shapes(saved)
    assert {k for k in stored if k.startswith(OPTIMIZER_PREFIX + "state.exp_avg.")}, "the optimizer state is there"

    exported = megatron_to_hf(saved, tmp_path / "exported", hf_config=hf, progress=False)
    back = resolve_iteration_dir(hf_to_megatron(exported, tmp_path / "back", fmt="torch_dist", progress=False))
    before = resolve_iteration_dir(start)
    model_keys = tensor_shapes(back)
    assert set(model_keys) == {k for k in stored if not k.startswith(OPTIMIZER_PREFIX)}
    moved = 0
    for key, (shape, dtype) in model_keys.items():
        theirs = whole(saved, key, shape, dtype)
        ours = whole(back, key, shape, dtype)
        rows = slice(0, VOCAB) if key in VOCAB_KEYS else slice(None)  # padding rows are not exported
        assert torch.equal(ours[rows], theirs[rows]), key
        moved += not torch.equal(theirs, whole(before, key, shape, dtype))
    assert moved == len(model_keys), "every tensor trained"
