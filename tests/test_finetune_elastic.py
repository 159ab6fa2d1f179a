"""Elastic resume: a checkpoint written at one TP x PP x DP x ZeRO resumes at another and repeats
the uninterrupted run's losses and gradient norms (fp32: only the reduction order differs)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.finetune_harness import REPO, launch, read_metrics, recipe
from tests.test_checkpoint_opened_once import counting_opens
from tests.test_finetune_checkpoint import model_and_data  # noqa: F401  (the shared fixture)

LOSS_RTOL, GRAD_NORM_RTOL = 1e-6, 1e-5
SAVED_STEP, STEPS = 5, 10
# The recipe with Adam's moments left at zero on an elastic resume (patched in the worker).
WITHOUT_MOMENTS = REPO / "tests" / "recipe_without_moments.py"


def max_rel(resumed: list[dict], straight: list[dict], key: str) -> float:
    ours = {m["step"]: m[key] for m in resumed}
    assert sorted(ours) == list(range(SAVED_STEP + 1, STEPS + 1)), "steps 6-10 logged once each"
    return max(abs(ours[m["step"]] - m[key]) / abs(m[key]) for m in straight if m["step"] > SAVED_STEP)


def straight_run(tmp: Path, mc, data, nprocs: int, parallel: dict) -> tuple[Path, list[dict]]:
    """10 steps straight, saving at step 5 (the resume point of every elastic run)."""
    directory = tmp / "straight"
    directory.mkdir()
    launch(nprocs, recipe(directory, mc, data, parallel=parallel, save_every=SAVED_STEP, keep_last=2, steps=STEPS))
    return directory / "run" / "checkpoints" / f"step_{SAVED_STEP:07d}", read_metrics(directory / "run")


def resume_at(tmp: Path, name: str, saved: Path, mc, data, nprocs: int, parallel: dict, **launch_args) -> list[dict]:
    """Steps 6-10 on another layout from a copy of the step-5 checkpoint."""
    directory = tmp / name
    checkpoints = directory / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(saved, checkpoints / saved.name)
    (checkpoints / "latest").write_text(saved.name)
    launch(nprocs, recipe(directory, mc, data, parallel=parallel, steps=STEPS), "resume=auto", **launch_args)
    return read_metrics(directory / "run")


def report(name: str, resumed: list[dict], straight: list[dict]) -> tuple[float, float]:
    loss, norm = max_rel(resumed, straight, "loss"), max_rel(resumed, straight, "grad_norm")
    print(f"{name}: max relative diff steps 6-10: loss {loss:.2e}, grad norm {norm:.2e}", flush=True)
    return loss, norm


@pytest.fixture(scope="module")
def tp2_pp2_dp2_straight(model_and_data, tmp_path_factory):
    """10 steps at TP2 x PP2 x DP2 ZeRO-1 on 8 processes, saved at step 5: the one straight run every
    elastic resume here starts from."""
    hf, mc, data = model_and_data
    return straight_run(tmp_path_factory.mktemp("tp2pp2dp2"), mc, data, 8, {"tp": 2, "pp": 2, "zero_stage": 1})


@pytest.mark.multiprocess
def test_small_layouts_resume_each_other_and_moments_matter(model_and_data, tp2_pp2_dp2_straight, tmp_path):
    """TP2 x PP2 x DP2 ZeRO-1 -> TP2 ZeRO-2, DP2 ZeRO-3, and TP4 (whose padded vocabulary is 512 rows,
    not 256: megatron-core's embedding sharding allows the mismatch); without Adam's moments it breaks."""
    hf, mc, data = model_and_data
    saved, straight = tp2_pp2_dp2_straight
    layouts = {"tp2-zero2": (2, {"tp": 2, "pp": 1, "zero_stage": 2}), "dp2-zero3": (2, {"tp": 1, "pp": 1, "zero_stage": 3}),
               "tp4-zero1": (4, {"tp": 4, "pp": 1, "zero_stage": 1})}
    for name, (nprocs, parallel) in layouts.items():
        loss, norm = report(name, resume_at(tmp_path, name, saved, mc, data, nprocs, parallel), straight)
        assert loss <= LOSS_RTOL and norm <= GRAD_NORM_RTOL, name

    guard = resume_at(tmp_path, "no-moments", saved, mc, data, 2, layouts["dp2-zero3"][1],
                      script=WITHOUT_MOMENTS)
    loss, _ = report("dp2-zero3 without Adam moments (guard)", guard, straight)
    assert loss > 100 * LOSS_RTOL, "dropping the optimizer moments must break the match"


@pytest.mark.multiprocess
def test_resharded_checkpoint_resumes_at_its_new_layout_and_exports_the_same_weights(model_and_data,
                                                                                     tp2_pp2_dp2_straight, tmp_path):
    """`toolkit ckpt reshard` TP2 x PP2 -> TP2 x PP1: the output resumes with resume=auto (steps 6-10 as the
    straight run), its model/ exports the same HF weights; bad requests are one line, nothing written."""
    from safetensors.torch import load_file

    from toolkit.convert import megatron_to_hf
    from toolkit.errors import ToolkitError
    from toolkit.train.checkpoint_info import describe, lines
    from toolkit.train.reshard import reshard

    hf, mc, data = model_and_data
    saved, straight = tp2_pp2_dp2_straight
    out = reshard(saved, tmp_path / "resharded", tp=2, pp=1)
    assert lines(describe(out))[0].endswith("written at TP 2 x PP 1 x any DP and ZeRO stage (resharded)")
    for wrong, match in (({"tp": 3, "pp": 1}, "not divisible"), ({"tp": 2, "pp": 1}, "exists and is not empty")):
        with pytest.raises(ToolkitError, match=match) as caught:
            reshard(saved, tmp_path / ("resharded" if wrong["tp"] == 2 else "tp3"), **wrong)
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "tp3").exists()

    exports = [megatron_to_hf(step / "model", tmp_path / name, progress=False)
               for name, step in (("hf-before", saved), ("hf-after", out / "checkpoints" / saved.name))]
    before, after = (load_file(next(Path(d).glob("*.safetensors"))) for d in exports)
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)

    (tmp_path / "resume").mkdir()
    launch(2, recipe(tmp_path / "resume", mc, data, parallel={"tp": 2, "pp": 1, "zero_stage": 1}, steps=STEPS,
                     run_dir=str(out)), "resume=auto")
    loss, norm = report("resharded to tp2, resumed", read_metrics(out), straight)
    assert loss <= LOSS_RTOL and norm <= GRAD_NORM_RTOL


@pytest.mark.multiprocess
def test_tp2_pp2_dp2_resumes_at_tp1_pp2_dp4_tp2_dp4_zero2_and_dp8_zero3(model_and_data, tp2_pp2_dp2_straight,
                                                                      tmp_path):
    """The acceptance matrix: 8 processes each, the straight run and three resumes."""
    hf, mc, data = model_and_data
    saved, straight = tp2_pp2_dp2_straight
    layouts = {"tp1-pp2-dp4-zero1": {"tp": 1, "pp": 2, "zero_stage": 1},
               "tp2-pp1-dp4-zero2": {"tp": 2, "pp": 1, "zero_stage": 2},
               "dp8-zero3": {"tp": 1, "pp": 1, "zero_stage": 3}}
    for name, parallel in layouts.items():
        loss, norm = report(name, resume_at(tmp_path, name, saved, mc, data, 8, parallel), straight)
        assert loss <= LOSS_RTOL and norm <= GRAD_NORM_RTOL, name


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.multiprocess
def test_bad_resumes_are_one_line_before_training_and_nothing_is_written(model_and_data, tmp_path, monkeypatch):
    """Another model, a missing or truncated shard, a changed global batch, a TP that does not
    divide the heads, `steps` extending a cosine that ended at LR 0: refused by `prepare` (before any
    process group), the run directory untouched."""
    from recipes.finetune import prepare
    from toolkit.convert import hf_to_megatron
    from toolkit.errors import ToolkitError
    from toolkit.tinymodels import make_tiny_model
    from toolkit.train.checkpoint_info import describe

    hf, mc, data = model_and_data
    # No warmup: the one step decays the cosine to optim.min_lr=0, so the run is finished at LR 0.
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 1, "pp": 1, "zero_stage": 1}, steps=1, optim__warmup_steps=0)
    launch(2, cfg)
    run = tmp_path / "run"
    shard = next((run / "checkpoints" / "step_0000001" / "train").glob("*.distcp"))
    ds_files = {p.name for p in (run / "checkpoints" / "step_0000001" / "ds").glob("*.pt")}
    assert ds_files == {"mp_rank_00_model_states.pt"}, "train/ holds the optimizer state: no ZeRO files beside it"
    before = tree_state(run)
    monkeypatch.setenv("WORLD_SIZE", "2")

    # Accepted, each of the resume point's train_state.json and train/ index read once (both were
    # read twice: checked for damage, then again by the resume's checks)
    step_dir = (run / "checkpoints" / "step_0000001").resolve()
    for resume in ("auto", str(step_dir)):
        with monkeypatch.context() as patch:
            opens = counting_opens(patch)
            prepared = prepare(str(cfg), [f"resume={resume}"])
        assert prepared.resume_from.resolve() == step_dir and prepared.same_layout
        read = {name: opens[step_dir / name] for name in ("train_state.json", "train/.metadata")}
        assert read == {"train_state.json": 1, "train/.metadata": 1}, (resume, read)

    def refused(match: str, config=cfg, overrides=()):
        with pytest.raises(ToolkitError, match=match) as caught:
            prepare(str(config), ["resume=auto", "parallel.tp=2", *overrides])
        assert "\n" not in str(caught.value)
        assert tree_state(run) == before, "a refused resume writes nothing"

    refused("keeps its global batch", overrides=["global_batch=8"])
    refused("attention heads are not divisible", overrides=["parallel.tp=3"])
    refused("steps=3 extends a run whose cosine schedule already decayed to optim.min_lr=0 at step 1: its 2 extra "
            f"steps would train at LR 0. Start a new run_dir from its weights instead \\(model.checkpoint={re.escape(str(run))}/checkpoints/"
            "step_0000001/model", overrides=["steps=3"])
    monkeypatch.setenv("WORLD_SIZE", "6")  # DP 3 cannot keep a global batch of 16
    refused("world sizes keeping global_batch 16 at TP 2 x PP 1, micro_batch 2: 2 \\(DP 1\\), 4 \\(DP 2\\), "
            "8 \\(DP 4\\), 16 \\(DP 8\\)$")
    monkeypatch.setenv("WORLD_SIZE", "2")

    other_hf = make_tiny_model("llama", tmp_path / "other-hf", dtype="float32", num_hidden_layers=4)
    other = hf_to_megatron(other_hf, tmp_path / "other-mc", fmt="torch_dist", progress=False)
    (tmp_path / "other").mkdir()
    other_cfg = recipe(tmp_path / "other", other, data, steps=1, run_dir=str(run))
    refused("checkpoint of another model \\(.*vocab_size 250 -> 256", config=other_cfg)

    info = describe(run)  # `toolkit ckpt inspect`, on the intact checkpoint
    assert (info["step"], info["layout"], info["samples_seen"], info["tokens_seen_padded"]) == \
        (1, {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1}, 16, 16 * 24)
    assert info["tensors"]["exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight"] == [[4, 128, 64], "float32"]
    assert info["resumable"] == {"tp": [1, 2, 4], "pp": [1, 2, 4], "dp": [1, 2, 4, 8, 16]}

    saved = shard.read_bytes()
    shard.write_bytes(saved[: len(saved) // 2])
    before = tree_state(run)
    refused("is truncated")
    shard.unlink()
    before = tree_state(run)
    refused("is missing: the checkpoint is incomplete")
    with pytest.raises(ToolkitError, match="is missing"):
        describe(run)
