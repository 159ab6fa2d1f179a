"""The GPU recipes in recipes/: each one loads through the recipe's own config checks, is a layout
`plan` ranks as fitting its cluster, is priced under 80 GiB by `memory`'s estimate on the Setup
the recipe builds, gets a DeepSpeed config from the recipe's own builder, and renders as a Slurm
job (no GPU needed). The models' config.json files are in ds_configs/models/ (published HF configs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.memory import GIB, GPU, estimate
from toolkit.modelspec import read

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "ds_configs" / "models"
GPU_MEMORY = 80 * GIB
GPUS_PER_NODE = 8

# recipe -> (model config under ds_configs/models, nodes of 8 x 80 GiB)
RECIPES = {
    "llama-3.1-8b-lora.yaml": ("llama-3.1-8b", 1),
    "llama-3.1-8b-full.yaml": ("llama-3.1-8b", 1),
    "qwen3-8b-full.yaml": ("qwen3-8b", 1),
    "qwen3-30b-a3b-ep.yaml": ("qwen3-30b-a3b", 2),
    "llama-3.3-70b-full.yaml": ("llama-3.3-70b", 8),
}


def test_every_gpu_recipe_is_listed_here():
    listed = {p.name for p in (ROOT / "recipes").glob("*.yaml")} - {"tiny-cpu.yaml"}
    assert listed == set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_gpu_recipe_is_planned_priced_and_rendered(name, tmp_path):
    from toolkit.memory.lora import LoraShape
    from toolkit.plan import Cluster, plan
    from toolkit.slurm.render import Resources, SlurmJob, render
    from toolkit.train.build import data_parallel_size, ds_config, ds_setup
    from toolkit.train.config import load_config

    model, nodes = RECIPES[name]
    recipe = ROOT / "recipes" / name
    cfg = load_config(str(recipe))
    spec = read(MODELS / model)
    gpus = nodes * GPUS_PER_NODE
    dp = data_parallel_size(cfg, gpus)
    p = cfg.parallel
    lora = LoraShape(cfg.peft.r, tuple(cfg.peft.target_modules.split(","))) if cfg.peft.enabled else None
    recompute = p.recompute or "none"
    if spec.is_moe:  # the recipe's own expert-layout rules (EP divides DP, sequence parallelism at TP > 1)
        from toolkit.train.build import check_expert_layout

        check_expert_layout(cfg, dp, spec.family)

    # planned: plan ranks this very layout among those that fit the cluster
    result = plan(spec, Cluster(gpus, GPU_MEMORY, GPUS_PER_NODE), cfg.data.seq_len, cfg.global_batch,
                  cfg.precision, lora=lora, allow_offload=False)
    same = [c for c in result.ranked if (c.setup.tp, c.setup.pp, c.setup.zero, c.setup.micro_batch, c.recompute,
                                         c.memory.ep) == (p.tp, p.pp, p.zero_stage, cfg.micro_batch, recompute, p.ep)]
    assert same, f"{name}: plan does not rank this layout as fitting"

    # priced on the Setup the recipe builds, with its sequence parallelism
    setup = ds_setup(cfg, dp)
    memory = estimate(spec, setup, cfg.data.seq_len, recompute, GPU, p.sequence_parallel, lora=lora, ep=p.ep)
    assert memory.fits(GPU_MEMORY), "\n".join(memory.table())
    config = ds_config(cfg, spec, dp)
    assert config["zero_optimization"]["stage"] == p.zero_stage and config["bf16"]["enabled"]

    # rendered: the Slurm job for its cluster, checked against the model
    text = render(SlurmJob(config=str(recipe), resources=Resources(nodes=nodes, gpus_per_node=GPUS_PER_NODE),
                           model=str(MODELS / model), workdir=str(tmp_path)))
    assert f"#SBATCH --nodes={nodes}" in text and "#SBATCH --gpus-per-node=8" in text


def test_a_gpu_job_keeping_the_tiny_cpu_examples_values_is_refused_in_one_line(tmp_path):
    """Old code rendered recipes/tiny-cpu.yaml for 2 x 8 GPUs with its quick-start data, run_dir and lr 3e-3."""
    from toolkit.errors import SlurmError
    from toolkit.slurm.render import Resources, SlurmJob, render

    example = str(ROOT / "recipes" / "tiny-cpu.yaml")
    gpu = Resources(nodes=2, gpus_per_node=8)
    with pytest.raises(SlurmError, match=r"keeps the tiny CPU example's data.train_file=quickstart_out/data/train.jsonl, "
                                         r"data.valid_file=.*, run_dir=quickstart_out/run, optim.lr=0.003") as refused:
        render(SlurmJob(config=example, resources=gpu, workdir=str(tmp_path)))
    assert "\n" not in str(refused.value)
    with pytest.raises(SlurmError, match=r"keeps the tiny CPU example's optim.lr=0.003: give your own"):
        render(SlurmJob(config=example, overrides=("data.train_file=mine.jsonl", "data.valid_file=none",
                                                   "run_dir=runs/mine"), resources=gpu, workdir=str(tmp_path)))
    overridden = ("data.train_file=mine.jsonl", "data.valid_file=none", "run_dir=runs/mine", "optim.lr=1e-5",
                  "optim.min_lr=0")
    assert "#SBATCH --nodes=2" in render(SlurmJob(config=example, overrides=overridden, resources=gpu,
                                                  workdir=str(tmp_path)))
    cpu = Resources(nodes=2, procs_per_node=2)  # the example itself, on CPU nodes, stays allowed
    assert "NPROC_PER_NODE=2" in render(SlurmJob(config=example, resources=cpu, workdir=str(tmp_path)))
