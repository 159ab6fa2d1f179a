"""`toolkit plan -o DIR`: a bundle that runs the planned layout, with the DeepSpeed config plan priced;
and ranks that end with their `deepspeed` launcher when it is killed with -9, then resume exactly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.finetune_harness import RECIPE, launch, read_metrics
from toolkit.memory import GIB

PLAN_ARGS = ["--gpus", "4", "--gpu-memory", "4GiB", "--seq-len", "16", "--global-batch", "16", "--precision", "fp32",
             "--top", "5"]
# The run's own length: plan knows no step count (recipe.yaml keeps the recipe's defaults).
RUN = ["steps=6", "save_every=2", "log_every=1", "export_hf=false"]
GONE_WITHIN_S = 5


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory):
    """The quick start's tiny Llama and its digit-reversal data, converted as the quick start does."""
    from toolkit.convert import hf_to_megatron
    from toolkit.examples import write_reversal_task
    from toolkit.quickstart import TINY
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("bundle")
    hf = make_tiny_model("llama", root / "hf", dtype="float32", **TINY)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    train, _, _ = write_reversal_task(root / "data")
    return mc, train


def plan_bundle(mc: Path, data: Path, out: Path, capsys, *more: str) -> dict:
    from toolkit.cli import main

    assert main(["plan", "--model", str(mc), *PLAN_ARGS, "--data", str(data), "-o", str(out), *more]) == 0
    printed = capsys.readouterr()
    return {"out": printed.out, "err": printed.err, "recipe": yaml.safe_load((out / "recipe.yaml").read_text())}


def priced_deepspeed(out: Path) -> dict:
    text = (out / "PLAN.md").read_text()
    return json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])


def test_plan_writes_a_recipe_its_job_and_plan_md_priced_on_the_recipes_own_config(quickstart_model, tmp_path, capsys):
    """Old code: `plan -o DIR` wrote one DeepSpeed JSON (the recipe never read it) whose
    train_micro_batch_size_per_gpu was not the row's micro-batch, and named `recompute=` (no such key)."""
    from toolkit import modelspec
    from toolkit.cli import main
    from toolkit.train.build import ds_config, ds_setup
    from toolkit.train.config import load_config

    mc, data = quickstart_model
    out = tmp_path / "bundle"
    planned = plan_bundle(mc, data, out, capsys)
    assert sorted(p.name for p in out.iterdir()) == ["PLAN.md", "job.sbatch", "recipe.yaml"]
    recipe = planned["recipe"]
    assert recipe["model"]["checkpoint"] == str(mc) and recipe["data"]["train_file"] == str(data)
    assert recipe["data"]["seq_len"] == 16 and recipe["run_dir"] == str(out / "run")
    assert "recompute" in recipe["parallel"] and "parallel.recompute=" in planned["err"]

    # The best row is what recipe.yaml says, in the recipe's key names.
    best = planned["out"].splitlines()[1]
    p = recipe["parallel"]
    assert best.startswith(f"  1. TP{p['tp']} ") and f"ZeRO-{p['zero_stage']}" in best
    assert f"mb {recipe['micro_batch']}, recompute {p['recompute'] or 'none'}" in best

    # The DeepSpeed config PLAN.md shows is the one the recipe builds from recipe.yaml (the same
    # function, toolkit.train.build.ds_setup), and the memory is priced on that Setup.
    cfg = load_config(str(out / "recipe.yaml"))
    spec = modelspec.read(mc)
    dp = 4 // (p["tp"] * p["pp"])
    assert priced_deepspeed(out) == ds_config(cfg, spec, dp)
    setup = ds_setup(cfg, dp)
    assert (setup.micro_batch, setup.global_batch, setup.gpus) == (recipe["micro_batch"], 16, 4)
    assert priced_deepspeed(out)["train_micro_batch_size_per_gpu"] == 16 // dp  # explained in PLAN.md
    assert f"is the {16 // dp} sequences of each DP rank" in (out / "PLAN.md").read_text()

    # job.sbatch is what `toolkit slurm render` writes for this recipe on the planned GPUs.
    rendered = tmp_path / "rendered.sbatch"
    assert main(["slurm", "render", str(out / "recipe.yaml"), "--gpus-per-node", "4", "-o", str(rendered)]) == 0
    assert (out / "job.sbatch").read_text() == rendered.read_text()

    # Nothing is written over a bundle, and no bundle for a layout the recipe cannot run.
    assert main(["plan", "--model", str(mc), *PLAN_ARGS, "-o", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["plan", "--model", str(mc), *PLAN_ARGS, "--schedule", "deepspeed", "-o", str(tmp_path / "b2")]) == 2
    assert not (tmp_path / "b2").exists()


def test_bundle_of_an_hf_model_says_to_convert_and_points_at_the_converted_path(tmp_path, capsys):
    from toolkit.cli import main

    models = Path(__file__).resolve().parents[1] / "ds_configs" / "models"
    out = tmp_path / "plan-8b"
    assert main(["plan", "--model", str(models / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80GiB", "--top", "2",
                 "--lora-r", "16", "-o", str(out)]) == 0
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["model"]["checkpoint"] == f"{models / 'llama-3-8b'}-megatron"
    assert recipe["peft"] == {"enabled": True, "r": 16, "target_modules": "all-linear"}
    assert recipe["data"]["train_file"] == str(out / "train.jsonl")
    text = (out / "PLAN.md").read_text()
    assert f"toolkit convert hf-to-megatron {models / 'llama-3-8b'} {models / 'llama-3-8b'}-megatron" in text
    assert "#SBATCH --gpus-per-node=8" in (out / "job.sbatch").read_text()


def test_moe_bundle_carries_expert_parallelism_and_the_recipes_expert_rules_accept_it(tmp_path, capsys):
    from toolkit.cli import main
    from toolkit.train.build import check_expert_layout, data_parallel_size
    from toolkit.train.config import load_config

    models = Path(__file__).resolve().parents[1] / "ds_configs" / "models"
    out = tmp_path / "plan-moe"
    assert main(["plan", "--model", str(models / "qwen3-30b-a3b"), "--nodes", "2", "--gpu-memory", "80GiB",
                 "--seq-len", "8192", "--global-batch", "16", "--top", "3", "-o", str(out)]) == 0
    capsys.readouterr()
    cfg = load_config(str(out / "recipe.yaml"))
    check_expert_layout(cfg, data_parallel_size(cfg, 16), "qwen3_moe")
    assert cfg.parallel.sequence_parallel == (cfg.parallel.tp > 1)  # megatron-core's rule for MoE at TP > 1
    assert "#SBATCH --nodes=2" in (out / "job.sbatch").read_text()


def descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.multiprocess
def test_planned_bundle_runs_under_deepspeed_and_its_ranks_die_with_the_launcher_then_resume_exactly(
        quickstart_model, tmp_path, capsys):
    """The acceptance run: plan -o DIR, then `deepspeed --num_gpus 4 recipes/finetune.py --config
    DIR/recipe.yaml model.checkpoint=... data.train_file=...` on 4 CPU processes runs the planned
    layout with the priced DeepSpeed config. Rank 0 is paused inside its 2nd save (step 4) and
    the `deepspeed` command is killed with -9: its ranks are gone within GONE_WITHIN_S (old code:
    they trained on), and `resume=auto` on the same port resumes from step 2 and repeats the
    losses the killed run logged for steps 3 and 4 (fp32: exactly)."""
    import psutil

    from toolkit.runtime.launch import free_port

    mc, data = quickstart_model
    out = tmp_path / "bundle"
    plan_bundle(mc, data, out, capsys)
    priced = priced_deepspeed(out)
    config = out / "recipe.yaml"
    given = [f"model.checkpoint={mc}", f"data.train_file={data}", *RUN]
    port = str(free_port())
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--master_port", port,
                 str(RECIPE), "--config", str(config), *given]
    flag = tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOOLKIT_FAULT_PAUSE": f"checkpoint-before-marker@2:{flag}"}
    proc = subprocess.Popen(deepspeed, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    left_behind = []
    try:
        deadline = time.monotonic() + 600
        while not flag.exists():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        left_behind = descendants(proc.pid)  # DeepSpeed's per-node launcher and the 4 ranks
        assert sum("deepspeed.launcher.launch" not in " ".join(p.cmdline()) for p in left_behind) == 4
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(left_behind, timeout=GONE_WITHIN_S)
        assert not alive, f"{alive} still running {time.monotonic() - killed_at:.1f} s after kill -9 of the launcher"
    finally:  # whatever the verdict, no process of this test outlives it
        for p in left_behind + (descendants(proc.pid) if proc.poll() is None else []):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.kill()
    output = proc.stdout.read()
    run = out / "run"
    resolved = json.loads((run / "resolved_config.json").read_text())
    recipe = yaml.safe_load(config.read_text())
    assert resolved["deepspeed"] == priced, "the run's DeepSpeed config is the one plan priced"
    assert {k: resolved["layout"][k] for k in ("tp", "pp", "zero_stage")} == {
        "tp": recipe["parallel"]["tp"], "pp": recipe["parallel"]["pp"], "zero_stage": recipe["parallel"]["zero_stage"]}
    assert resolved["layout"]["world_size"] == 4, output[-3000:]

    # The same port right away (no EADDRINUSE: nothing holds it any more), from the last complete
    # checkpoint (step 2), repeating the losses the killed run logged for steps 3 and 4. Forked ranks
    # (tests/forkrun.py) save the second launch's imports; the launcher under test is the first one.
    before_kill = {m["step"]: m["loss"] for m in read_metrics(run)}
    assert sorted(before_kill) == [1, 2, 3, 4]
    resumed = launch(4, config, *given, "resume=auto", env={"FORKRUN_MASTER_PORT": port})
    assert "resuming from" in resumed.stdout and "step 3/6 loss" in resumed.stdout
    after = read_metrics(run)
    assert [m["step"] for m in after] == list(range(1, 7))
    assert [m["loss"] for m in after[:4]] == [before_kill[s] for s in range(1, 5)], "fp32 resume must be exact"
