"""fp16 with dynamic loss scaling (toolkit.train.loss_scale): megatron-core's backward scales the
loss by DeepSpeed's scale, DeepSpeed unscales, detects overflow and skips.

fp16 ops run on CPU in torch 2.13 (matmul, linear and SDPA forward and backward, softmax, RMSNorm,
cross-entropy: toolkit/runtime/cpu_compat.py allow_deepspeed_fp16), so these runs compute in fp16.
Two launches of 2 processes, each checking several things:

* DP2 (ZeRO-1): steps 1-10 within FP16_LOSS_TOLERANCE of the fp32 HF reference; an inf planted
  in one micro-batch's loss on rank 1 at step 11 makes both ranks skip it and halve the scale;
  step 12 trains; inf from step 13 on stops the run after `loss_scale.max_consecutive_skips` = 3
  skipped steps in a row, with one clear error.
* PP2: steps 1-10 within the same tolerance (the first stage's backward is marked as scaled, or
  DeepSpeed raises); an inf at step 11 on the last stage is skipped by both stages.
* Guard, PP2: without the first stage's mark DeepSpeed refuses its backward (one short launch).
* Guard, DP2: a wrong loss scale (every loss multiplied by 2 before backward, tests/recipe_with_defect.py)
  leaves the losses within their bar (Adam and clipping hide a constant factor) and the gradient
  norms outside theirs.

The overflow is planted by tests/fp16_overflow_worker.py around the real recipe, not by the product.
"""

from __future__ import annotations

import json

import pytest

from tests.finetune_harness import (REPO, ReferenceCache, differences, hf_reference, launch, read_metrics, recipe,
                                    write_uneven_data)

# fp16 keeps 10 mantissa bits (bf16: 7, whose bar is 2e-2): losses within 2e-3 of the fp32
# reference over 10 steps (measured 3.2e-4 at DP2 and 2.8e-4 at PP2; the tests print it), and
# gradient norms within FP16_GRAD_NORM_TOLERANCE relative.
FP16_LOSS_TOLERANCE = 2e-3
FP16_GRAD_NORM_TOLERANCE = 1e-2
WORKER = REPO / "tests" / "fp16_overflow_worker.py"
# 2**10: tiny-model gradients times the scale stay far below fp16's 65504, so no step overflows by itself.
FP16 = {"precision": "fp16", "loss_scale__initial_scale_power": 10, "loss_scale__hysteresis": 1,
        "loss_scale__max_consecutive_skips": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("fp16")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    return hf, hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False), write_uneven_data(root / "data.jsonl", 300)


REFERENCES = ReferenceCache()


def reference(model, cfg, steps=10):
    """The fp32 HF reference's (losses, grad norms) over the first `steps` steps of the recipe at cfg."""
    hf, _, data = model
    return REFERENCES.get(cfg, lambda: hf_reference(hf, data, cfg, steps), hf, steps)


def launch_worker(model, tmp_path, parallel, steps, inf_rank, inf_steps, expect_failure=False, **env):
    _, mc, data = model
    cfg = recipe(tmp_path, mc, data, parallel=parallel, steps=steps, **FP16)
    records = tmp_path / "records"
    records.mkdir()
    result = launch(2, cfg, script=WORKER, expect_failure=expect_failure,
                    env={"FP16_INF_RANK": str(inf_rank), "FP16_INF_STEPS": inf_steps, "FP16_RECORD_DIR": str(records), **env})
    return result, cfg, records


def run_with_planted_inf(model, tmp_path, parallel, steps, inf_rank, inf_steps, expect_failure=False):
    result, cfg, records = launch_worker(model, tmp_path, parallel, steps, inf_rank, inf_steps, expect_failure)
    per_rank = [[json.loads(line) for line in (records / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    return result, read_metrics(tmp_path / "run"), per_rank, reference(model, cfg)


def assert_parity(metrics, reference, label):
    loss, norm = differences(metrics[:10], *reference)
    print(f"fp16 {label}: over 10 steps max |loss - fp32 reference| {loss:.2e}, grad norm relative {norm:.2e}")
    assert loss < FP16_LOSS_TOLERANCE and norm < FP16_GRAD_NORM_TOLERANCE, (loss, norm, metrics, reference)
    assert not any(m["step_skipped"] for m in metrics[:10])


def assert_all_ranks_skipped(per_rank, step, scale_before):
    for rank in per_rank:
        record = rank[step - 1]
        assert record["step"] == step and record["skipped"], rank
        assert record["loss_scale"] == scale_before / 2, rank


@pytest.mark.multiprocess
def test_fp16_dp2_matches_fp32_skips_a_planted_overflow_on_every_rank_and_stops_when_it_never_ends(model, tmp_path):
    result, metrics, per_rank, reference = run_with_planted_inf(
        model, tmp_path, {"tp": 1, "pp": 1, "zero_stage": 1}, 20, inf_rank=1, inf_steps="11,13-", expect_failure=True)
    assert_parity(metrics, reference, "DP2 ZeRO-1")
    scale = metrics[9]["loss_scale"]
    assert scale == 2.0**10 and metrics[9]["skipped_steps"] == 0
    assert_all_ranks_skipped(per_rank, 11, scale)
    step11, step12 = metrics[10], metrics[11]
    assert step11["step_skipped"] and step11["skipped_steps"] == 1 and step11["loss_scale"] == scale / 2
    assert not step12["step_skipped"] and step12["skipped_steps"] == 1  # training continues
    assert step12["loss"] < metrics[9]["loss"] + 0.5
    # inf from step 13 on: 13, 14, 15 skipped, then one line and a non-zero exit, never step 16
    assert [r["step"] for r in per_rank[0]] == list(range(1, 16)) and all(r["skipped"] for r in per_rank[1][12:])
    output = result.stdout + result.stderr
    assert "error (rank 0): fp16: the last 3 steps (up to step 15) all overflowed and were skipped" in output
    assert "LossScaleError" not in output  # one line per rank, not a traceback (torchrun adds its own summary)


@pytest.mark.multiprocess
def test_fp16_pp2_matches_fp32_and_both_stages_skip_an_overflow_on_the_last(model, tmp_path):
    _, metrics, per_rank, reference = run_with_planted_inf(
        model, tmp_path, {"tp": 1, "pp": 2, "zero_stage": 1}, 12, inf_rank=1, inf_steps="11")
    assert_parity(metrics, reference, "PP2")
    assert_all_ranks_skipped(per_rank, 11, metrics[9]["loss_scale"])
    assert not metrics[11]["step_skipped"] and metrics[11]["skipped_steps"] == 1


@pytest.mark.multiprocess
def test_guard_fp16_pp2_first_stage_backward_is_refused_without_its_scaled_mark(model, tmp_path):
    result, _, _ = launch_worker(model, tmp_path, {"tp": 1, "pp": 2, "zero_stage": 1}, 1, inf_rank=1, inf_steps="99",
                                 expect_failure=True, FP16_WITHOUT_STAGE_HOOK="1")
    assert "Loss scaling is required for this configuration" in result.stdout + result.stderr


@pytest.mark.multiprocess
def test_guard_fp16_dp2_wrong_loss_scale_passes_the_loss_bar_and_fails_the_grad_norm_bar(model, tmp_path):
    _, mc, data = model
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 1, "pp": 1, "zero_stage": 1}, steps=3, **FP16)
    launch(2, cfg, script=REPO / "tests" / "recipe_with_defect.py", env={"DEFECT": "loss-factor:2"})
    loss, norm = differences(read_metrics(tmp_path / "run"), *reference(model, cfg, 3))
    print(f"fp16 DP2, loss scaled 2x: max |loss - fp32 reference| {loss:.2e}, grad norm relative {norm:.2e}")
    assert loss < FP16_LOSS_TOLERANCE and norm > FP16_GRAD_NORM_TOLERANCE, (loss, norm)
