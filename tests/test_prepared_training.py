"""A fine-tune from prepared data is the in-memory path's, bit for bit (issue 39): the real recipe
launched on the same data with data.prepared=true and false gives the same loss and gradient norm
at every step, exactly, for SFT packed at DP 2 (shuffled, past one epoch) and for DPO; the prepared
run resumed from its step-2 checkpoint (its second start, from the cache) continues with the same
figures. The batch-level equality, for every row kind, is tests/test_prepared_data.py's."""

from __future__ import annotations

import pytest

from tests.dpo_reference import write_preference_data
from tests.finetune_harness import launch, read_metrics, recipe, write_uneven_data
from toolkit.convert import hf_to_megatron

STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("prepared-training")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=2, vocab_size=250)
    return root, hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)


def _figures(run_dir):
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(run_dir) if "loss" in m]


@pytest.mark.multiprocess
def test_sft_packed_at_dp2_from_the_cache_is_bit_identical_and_resumes_exactly(model, tmp_path):
    root, mc = model
    data = write_uneven_data(tmp_path / "data.jsonl", 40)
    # 40 samples pack into fewer rows than 4 steps x 8: the order wraps into a second, reshuffled epoch
    keys = dict(data__pack=True, data__shuffle=True, global_batch=8, micro_batch=2, steps=STEPS, save_every=2)
    figures = {}
    for prepared in (False, True):
        (tmp_path / str(prepared)).mkdir()
        cfg = recipe(tmp_path / str(prepared), mc, data, data__prepared=prepared, **keys)
        launch(2, cfg)
        figures[prepared] = _figures(tmp_path / str(prepared) / "run")
    assert len(figures[True]) == STEPS and figures[True] == figures[False]
    cache = tmp_path / "True" / "run" / "data_cache" / "prepared"
    assert [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert not (tmp_path / "False" / "run" / "data_cache" / "prepared").exists()

    run_dir = tmp_path / "True" / "run"
    (run_dir / "checkpoints" / "latest").write_text("step_0000002")
    result = launch(2, tmp_path / "True" / "recipe.yaml", "resume=auto", "steps=4")
    assert "prepared " not in result.stderr  # the second start opened the cache
    resumed = [f for f in _figures(run_dir) if f[0] > 2]
    assert resumed[-2:] == figures[True][2:]


@pytest.mark.multiprocess
def test_dpo_from_the_cache_is_bit_identical(model, tmp_path):
    root, mc = model
    data = write_preference_data(tmp_path / "pairs.jsonl", 24)
    figures = {}
    for prepared in (False, True):
        (tmp_path / str(prepared)).mkdir()
        cfg = recipe(tmp_path / str(prepared), mc, data, method="dpo", data__prepared=prepared, data__shuffle=True,
                     optim={"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"}, global_batch=4, micro_batch=2,
                     steps=STEPS)
        launch(1, cfg)
        figures[prepared] = _figures(tmp_path / str(prepared) / "run")
    assert len(figures[True]) == STEPS and figures[True] == figures[False]
