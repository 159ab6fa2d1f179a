"""`toolkit plan -o DIR`: the best layout as a bundle that runs as is.

    DIR/recipe.yaml   the layout in the recipe's own keys, with the model and data paths given
    DIR/job.sbatch    what `toolkit slurm render DIR/recipe.yaml` writes for the planned cluster
    DIR/PLAN.md       the ranked table, why this layout, its memory per GPU, the DeepSpeed config

The DeepSpeed config and the memory in PLAN.md are priced on the Setup that recipes/finetune.py
builds from recipe.yaml (toolkit.train.build.ds_setup), not on the planner's own: what plan
shows is what the run gets.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.memory import GIB, GPU, Estimate, estimate
from toolkit.plan import Candidate, Plan

RECIPE, JOB, PLAN = "recipe.yaml", "job.sbatch", "PLAN.md"
RUN_DIR = "run"
DEFAULT_TRAIN_FILE = "train.jsonl"  # in DIR, when no --data is given
# The Setup fields the memory estimate and the throughput model price: the recipe's must equal them.
PRICED_FIELDS = ("gpus", "tp", "pp", "vpp", "zero", "precision", "micro_batch", "global_batch",
                 "offload_optimizer", "offload_param")


@dataclass
class Paths:
    """Where the bundle points the recipe (absolute, so that it runs from any directory)."""

    checkpoint: str  # a converted checkpoint (toolkit convert hf-to-megatron)
    train_file: str
    run_dir: str
    convert_from: str | None = None  # the HF model to convert first, when --model was not converted


@dataclass
class Bundle:
    plan: Plan
    candidate: Candidate  # the ranked layout the bundle runs
    recipe: dict  # recipe.yaml's mapping, in the recipe's key names
    memory: Estimate  # priced on the recipe's own Setup
    deepspeed: dict | None  # the config recipes/finetune.py builds for it (None under FSDP)
    seq_len: int
    paths: Paths

    @property
    def dp(self) -> int:
        return self.candidate.setup.dp


def paths_for(model: str, out: Path, data: str | None) -> Paths:
    """The checkpoint the recipe loads: `model` when it is a converted checkpoint, else where
    PLAN.md tells the user to convert it to (MODEL-megatron, next to it)."""
    from toolkit.convert.metadata import META_FILE

    source = Path(model).absolute()
    if source.is_file():  # a config.json
        source = source.parent
    out = out.absolute()
    train = str(Path(data).absolute()) if data else str(out / DEFAULT_TRAIN_FILE)
    if (source / META_FILE).is_file():
        return Paths(str(source), train, str(out / RUN_DIR))
    return Paths(f"{source}-megatron", train, str(out / RUN_DIR), convert_from=str(source))


def runnable(result: Plan) -> Candidate:
    """The best ranked layout the recipe runs: it has no CPU-offload keys, so offloaded layouts
    are priced by plan but cannot be bundled."""
    for candidate in result.ranked:
        if not candidate.offloaded:
            return candidate
    more = next((line.removeprefix("more GPUs: ") for line in result.advice if line.startswith("more GPUs")), None)
    raise ConfigError(f"only layouts with CPU offload fit {result.cluster.gpus} GPUs, and recipes/finetune.py does not "
                      f"offload: plan for more GPUs ({more or 'more nodes'}), a LoRA fine-tune (--lora-r R) "
                      "or a shorter --seq-len")


def recipe_mapping(c: Candidate, spec, seq_len: int, paths: Paths, lora=None, dp_engine: str = "deepspeed") -> dict:
    """The recipe keys of layout `c` (toolkit.train.config's names)."""
    s = c.setup
    parallel = {"tp": s.tp, "pp": s.pp, "zero_stage": s.zero,
                "recompute": None if c.recompute == "none" else c.recompute}
    if s.vpp > 1:
        parallel["vpp"] = s.vpp
    if c.memory.ep > 1:
        parallel["ep"] = c.memory.ep
    if c.memory.cp > 1:
        parallel["cp"] = c.memory.cp
    if spec.is_moe and s.tp > 1:  # megatron-core trains MoE at TP > 1 only with sequence parallelism
        parallel["sequence_parallel"] = True
    if dp_engine == "fsdp":
        parallel = {"tp": s.tp, "pp": 1, "dp_engine": "fsdp", "recompute": parallel["recompute"]}
    mapping = {
        "model": {"checkpoint": paths.checkpoint},
        "data": {"train_file": paths.train_file, "seq_len": seq_len},
        "parallel": parallel,
        "precision": s.precision,
        "micro_batch": s.micro_batch,
        "global_batch": s.global_batch // c.memory.cp,  # the Setup counts each CP rank's share of a sequence
        "run_dir": paths.run_dir,
    }
    if lora is not None:
        mapping["peft"] = {"enabled": True, "r": lora.r, "target_modules": ",".join(lora.target_modules)}
    return mapping


def make(result: Plan, spec, seq_len: int, paths: Paths, lora=None, dp_engine: str = "deepspeed") -> Bundle:
    """The bundle of the best runnable layout of `result`, priced on the recipe's own Setup."""
    from toolkit.train.build import ds_config, ds_setup
    from toolkit.train.config import config_from_mapping

    if result.best is None:
        raise ConfigError("nothing fits: no bundle to write (the notes above say what would)")
    c = runnable(result)
    mapping = recipe_mapping(c, spec, seq_len, paths, lora, dp_engine)
    cfg = config_from_mapping(mapping)
    setup = ds_setup(cfg, c.setup.dp // cfg.parallel.cp)
    differ = [f for f in PRICED_FIELDS if getattr(setup, f) != getattr(c.setup, f)]
    if differ:  # a bug here, never the user's: the bundle would run something plan did not price
        raise AssertionError(f"recipe.yaml would run another layout than plan priced: {differ}")
    memory = estimate(spec, setup, seq_len, c.recompute, GPU, cfg.parallel.sequence_parallel, lora=lora,
                      ep=cfg.parallel.ep, dp_engine=dp_engine, cp=cfg.parallel.cp)
    deepspeed = None if dp_engine == "fsdp" else ds_config(cfg, spec, c.setup.dp // cfg.parallel.cp)
    return Bundle(result, c, mapping, memory, deepspeed, seq_len, paths)


def recipe_text(bundle: Bundle, command: str) -> str:
    import yaml

    head = [
        f"# Planned by: {command}",
        f"# {PLAN} says why this layout. Run it with the command there, or: sbatch {JOB}",
        "# plan knows no learning rate or step count: optim.* and steps are the recipe's defaults",
        "# (set yours; recipes/*.yaml name the values the models' own fine-tuning guides use).",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(bundle.recipe, sort_keys=False)


def launch_command(bundle: Bundle, out: Path) -> str:
    gpus = bundle.candidate.setup.gpus
    cluster = bundle.plan.cluster
    from toolkit.slurm.render import DEFAULT_SCRIPT

    recipe = shlex.quote(str(out.absolute() / RECIPE))
    if gpus <= cluster.gpus_per_node:
        return f"deepspeed --num_gpus {gpus} {shlex.quote(DEFAULT_SCRIPT)} --config {recipe}"
    return f"sbatch {shlex.quote(str(out.absolute() / JOB))}"


def plan_text(bundle: Bundle, out: Path, command: str, top: int = 10) -> str:
    c, cluster, memory = bundle.candidate, bundle.plan.cluster, bundle.memory
    s = c.setup
    lines = [
        f"# Plan: {bundle.plan.cluster.gpus} x {cluster.gpu_memory / GIB:.0f} GiB GPUs "
        f"({cluster.gpus_per_node} per node), sequence {bundle.seq_len}, global batch {s.global_batch}",
        "",
        f"Made by `{command}`.",
        "",
        "## Run it",
        "",
    ]
    if bundle.paths.convert_from:
        lines += ["Convert the model first (the recipe loads a converted checkpoint):", "", "```",
                  f"toolkit convert hf-to-megatron {shlex.quote(bundle.paths.convert_from)} "
                  f"{shlex.quote(bundle.paths.checkpoint)} --format torch_dist", "```", ""]
    if bundle.paths.train_file == str(out.absolute() / DEFAULT_TRAIN_FILE):
        lines += [f"No `--data` was given: `data.train_file` is `{DEFAULT_TRAIN_FILE}` in this directory; "
                  "put your JSONL there or add `data.train_file=FILE` to the command.", ""]
    lines += ["```", launch_command(bundle, out), "```", "",
              f"or `sbatch {JOB}` (a Slurm job that requeues itself and resumes; re-render it with "
              f"`toolkit slurm render {RECIPE} ...` for other options).", "",
              "## Why this layout", "", c.explain(cluster), ""]
    lines += [f"- {line}" for line in bundle.plan.advice]
    if c is not bundle.plan.best:
        lines.append("- the faster layouts above it offload to CPU, which the recipe does not do")
    lines += ["", f"## Ranked layouts (best {min(top, len(bundle.plan.ranked))} of {len(bundle.plan.ranked)})", "",
              "| # | TP | PP | DP | CP | ZeRO | EP | micro-batch | recompute | offload | GiB/GPU | tok/s/GPU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(bundle.plan.ranked[:top], 1):
        rs = r.setup
        offload = "none" if not r.offloaded else f"{rs.offload_optimizer}/{rs.offload_param}"
        lines.append(f"| {i}{' (this)' if r is c else ''} | {rs.tp} | {rs.pp} | {rs.dp // r.memory.cp} | {r.memory.cp} | {rs.zero} | "
                     f"{r.memory.ep} | "
                     f"{rs.micro_batch} | {r.recompute} | {offload} | {r.memory.gpu_bytes / GIB:.1f} | "
                     f"{r.time.tokens_per_gpu_s:,.0f} |")
    lines += ["", "## Memory per GPU (the recipe's Setup)", "", "```", *memory.table(cluster.gpus_per_node), "```", ""]
    if bundle.deepspeed is not None:
        lines += ["## The DeepSpeed config the recipe builds for it", "",
                  f"megatron-core's schedule runs the {s.micro_batches} micro-batches of {s.micro_batch} (recipe key "
                  "`micro_batch`), so DeepSpeed sees one step per global batch: its `train_micro_batch_size_per_gpu` "
                  f"is the {s.global_batch // s.dp} sequences of each DP rank. Built from `{RECIPE}` by the function "
                  "the trainer uses (toolkit.train.build.ds_config).", "",
                  "```json", json.dumps(bundle.deepspeed, indent=2), "```", ""]
    return "\n".join(lines)


def slurm_job(bundle: Bundle, config: Path):
    """The job `toolkit slurm render` makes for the planned cluster (its defaults otherwise)."""
    from toolkit.slurm.render import Resources, SlurmJob

    gpus, per_node = bundle.candidate.setup.gpus, bundle.plan.cluster.gpus_per_node
    resources = Resources(nodes=max(1, -(-gpus // per_node)), gpus_per_node=min(gpus, per_node))
    return SlurmJob(config=str(config), resources=resources)


def refuse_overlap(paths: Paths, out: Path) -> None:
    """The bundle directory must not overlap the model or the data it names (checked first, before
    the recipe built for it is validated: a run_dir inside the model's config.json would otherwise
    be refused for a reason that hides this one)."""
    from toolkit.atomic import refuse_output_overlapping_inputs

    out = Path(out).absolute()
    given_data = None if paths.train_file == str(out / DEFAULT_TRAIN_FILE) else paths.train_file
    refuse_output_overlapping_inputs(out, paths.convert_from or paths.checkpoint, given_data)


def write(bundle: Bundle, out: Path, command: str, overwrite: bool = False, top: int = 10) -> Path:
    """Write the bundle whole or not at all: recipe.yaml and PLAN.md in a temporary directory,
    the Slurm job checked against it there, then the directory renamed into place and the job
    rendered against the final recipe path."""
    from toolkit.atomic import atomic_directory
    from toolkit.slurm.render import render, write as write_job

    out = Path(out).absolute()
    refuse_overlap(bundle.paths, out)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        (tmp / RECIPE).write_text(recipe_text(bundle, command))
        (tmp / PLAN).write_text(plan_text(bundle, out, command, top))
        render(slurm_job(bundle, tmp / RECIPE))  # every check `slurm render` makes, before anything is published
    write_job(slurm_job(bundle, out / RECIPE), out / JOB)
    return out
