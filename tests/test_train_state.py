"""What a run leaves in its directory and how it continues: the LR schedule across a resume,
checkpoint pruning, refusing another run's directory, one W&B run across local resumes."""

from __future__ import annotations

import re

import pytest

import yaml
from transformers import AutoTokenizer

from tests.finetune_harness import launch, read_metrics, recipe, reference_lr_factor, reference_samples, write_uneven_data
from toolkit.errors import ToolkitError
from toolkit.train import checkpoint
from toolkit.train.schedule import LRSchedule


def reference_factor(step: int, warmup: int, total: int, floor: float) -> float:
    return reference_lr_factor(step, warmup, total, floor)


def test_schedule_is_warmup_then_cosine_to_min_lr():
    schedule = LRSchedule(lr=2e-3, min_lr=2e-4, warmup_steps=5, total_steps=40, kind="cosine")
    for step in range(45):
        assert schedule(step) == pytest.approx(reference_factor(step, 5, 40, 0.1), abs=1e-12), step
    assert LRSchedule(1e-3, 0.0, 3, 40, "constant")(20) == 1.0


def test_extending_steps_continues_the_cosine_from_where_it_stands():
    """The issue's run: 40 steps, then steps=60 on resume. Before, the LR jumped from its step-40
    value back up the longer cosine; now it keeps decaying from there to min_lr at step 60."""
    old = LRSchedule(lr=3e-3, min_lr=3e-4, warmup_steps=5, total_steps=40, kind="cosine")
    at_resume = old(30)  # resumed from a checkpoint of step 30, mid-decay
    extended = LRSchedule.from_state(old.state())
    extended.continue_as(LRSchedule(3e-3, 3e-4, 5, 60, "cosine"), at_step=30)
    factors = [extended(step) for step in range(30, 61)]
    assert factors[0] == at_resume, "no jump at the resume step"
    assert all(a >= b for a, b in zip(factors, factors[1:])), "never rises again"
    assert factors[-1] == pytest.approx(0.1) and extended(70) == pytest.approx(0.1)
    # Extended again later: still continuous.
    again = LRSchedule.from_state(extended.state())
    again.continue_as(LRSchedule(3e-3, 3e-4, 5, 90, "cosine"), at_step=50)
    assert again(50) == extended(50) and again(90) == pytest.approx(0.1)


def test_extending_in_warmup_or_constant_schedule_simply_continues():
    warm = LRSchedule(1e-3, 0.0, 10, 20, "cosine")
    warm.continue_as(LRSchedule(1e-3, 0.0, 10, 40, "cosine"), at_step=5)
    assert [warm(s) for s in range(50)] == [reference_factor(s, 10, 40, 0.0) for s in range(50)]
    flat = LRSchedule(1e-3, 0.0, 2, 20, "constant")
    flat.continue_as(LRSchedule(1e-3, 0.0, 2, 100, "constant"), at_step=20)
    assert [flat(s) for s in range(20, 100)] == [1.0] * 80


def test_extending_a_cosine_that_decayed_to_zero_is_refused_naming_the_fix():
    """Defect: a finished cosine with optim.min_lr=0 (the default) ends at LR 0, and `steps=N` on
    resume went on from there: the extra steps trained at LR 0, silently."""
    finished = LRSchedule(3e-3, 0.0, 5, 40, "cosine")
    with pytest.raises(ToolkitError, match=r"steps=60 extends a run whose cosine schedule already decayed to "
                                           r"optim.min_lr=0 at step 40: its 20 extra steps would train at LR 0") as caught:
        finished.continue_as(LRSchedule(3e-3, 0.0, 5, 60, "cosine"), at_step=40, checkpoint="ckpt/step_0000040")
    assert "model.checkpoint=ckpt/step_0000040/model" in str(caught.value) and "\n" not in str(caught.value)
    # The legitimate resumes go on: the same steps (nothing left to train), a crash mid-schedule,
    # an extension from mid-decay, and a finished run with a floor above 0 (it stays at min_lr).
    LRSchedule(3e-3, 0.0, 5, 40, "cosine").continue_as(LRSchedule(3e-3, 0.0, 5, 40, "cosine"), at_step=40)
    LRSchedule(3e-3, 0.0, 5, 40, "cosine").continue_as(LRSchedule(3e-3, 0.0, 5, 40, "cosine"), at_step=30)
    mid = LRSchedule(3e-3, 0.0, 5, 40, "cosine")
    mid.continue_as(LRSchedule(3e-3, 0.0, 5, 60, "cosine"), at_step=39)
    assert mid(39) > 0
    floor = LRSchedule(3e-3, 3e-4, 5, 40, "cosine")
    floor.continue_as(LRSchedule(3e-3, 3e-4, 5, 60, "cosine"), at_step=40)
    assert floor(50) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "requested, match",
    [
        (LRSchedule(1e-3, 0.0, 10, 40, "cosine"), "lr 0.003 -> 0.001"),
        (LRSchedule(3e-3, 0.0, 10, 40, "constant"), "kind cosine -> constant"),
        (LRSchedule(3e-3, 0.0, 3, 40, "cosine"), "warmup_steps 10 -> 3"),
        (LRSchedule(3e-3, 0.0, 10, 15, "cosine"), "below the checkpoint's step 20"),
    ],
)
def test_changing_the_schedule_on_resume_is_refused(requested, match):
    with pytest.raises(ToolkitError, match=match):
        LRSchedule(3e-3, 0.0, 10, 40, "cosine").continue_as(requested, at_step=20)


def make_checkpoints(root, steps, latest):
    root.mkdir(parents=True)
    for step in steps:
        (root / checkpoint.step_name(step)).mkdir()
    (root / checkpoint.LATEST).write_text(checkpoint.step_name(latest))


def test_pruning_orders_by_step_and_never_deletes_latest_or_newer(tmp_path):
    # The quick-start bug: an old step_0000300 and a new step_0000010 that `latest` names.
    make_checkpoints(tmp_path / "a", [300, 10], latest=10)
    checkpoint._prune(tmp_path / "a", keep_last=1, latest_step=10)
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == ["step_0000010", "step_0000300"]
    # Names that sort wrongly as text (8 digits after 7).
    make_checkpoints(tmp_path / "b", [9_999_998, 9_999_999, 10_000_000], latest=10_000_000)
    checkpoint._prune(tmp_path / "b", keep_last=2, latest_step=10_000_000)
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_10000000", "step_9999999"]


def test_a_fresh_run_refuses_a_directory_holding_another_run(tmp_path):
    make_checkpoints(tmp_path / "run" / "checkpoints", [300], latest=300)
    with pytest.raises(ToolkitError, match=r"already holds.*step_0000300.*resume=auto.*new or empty run_dir"):
        checkpoint.refuse_used_run_dir(tmp_path / "run", "none")
    checkpoint.refuse_used_run_dir(tmp_path / "run", "auto")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ToolkitError, match="metrics.jsonl"):
        checkpoint.refuse_used_run_dir(tmp_path / "other", "none")


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("state")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=2, vocab_size=250)
    return hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False), write_uneven_data(root / "data.jsonl", 100)


@pytest.mark.multiprocess
def test_run_dir_is_refused_then_resumed_with_more_steps_in_one_wandb_run(model_and_data, tmp_path):
    """The README's order: a run, a second fresh run into the same directory (refused with one
    line before training, nothing touched), then the first run extended with resume=auto: the LR
    goes on from where it stood and W&B continues the same run."""
    from toolkit.wandb_offline import read_runs

    mc, data = model_and_data
    cfg = recipe(tmp_path, mc, data, steps=4, optim={"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 1, "schedule": "cosine"},
                 wandb={"enabled": True, "mode": "offline"})
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = launch(1, cfg, env=env, launcher="torchrun")  # its own imports, as a user's run makes them
    noise = [line for line in (first.stdout + first.stderr).splitlines()
             if "Warning" in line or "[WARNING]" in line or re.match(r"W\d{4} ", line)]  # glog-style: torch's logging
    assert not noise, f"third-party notices are hidden without --verbose: {noise}"
    run = tmp_path / "run"
    # Throughput counts real tokens: step 1's share of non-padding inputs, from the data itself.
    tokenizer = AutoTokenizer.from_pretrained(mc / "hf")
    seq_len = yaml.safe_load(cfg.read_text())["data"]["seq_len"]
    first_batch = reference_samples(tokenizer, data, seq_len + 1)[:16]
    real_share = sum(min(len(tokens), seq_len) for tokens, _ in first_batch) / (16 * seq_len)
    step1 = read_metrics(run)[0]
    assert step1["tokens_per_s"] / step1["padded_tokens_per_s"] == pytest.approx(real_share, rel=1e-9)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())

    refused = launch(1, cfg, "steps=2", env=env, expect_failure=True)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "already holds" in errors[0], refused.stderr[-3000:]
    assert "step 1 " not in refused.stdout, "refused before training"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before

    launch(1, cfg, "steps=8", "resume=auto", env=env)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    lrs = [m["lr"] for m in metrics]
    expected_first = [2e-3 * reference_factor(s, 1, 4, 0.1) for s in range(4)]
    assert lrs[:4] == pytest.approx(expected_first, rel=1e-9)
    assert lrs[4:] == pytest.approx([2e-4] * 4, rel=1e-9), f"the LR rose again after the resume: {lrs}"
    runs = read_runs(run / "wandb")
    assert len(runs) == 1, f"one W&B run across the resume, got {sorted(runs)}"
    (history,) = runs.values()
    assert history.steps == list(range(1, 9)) and len(history.segments) == 2
