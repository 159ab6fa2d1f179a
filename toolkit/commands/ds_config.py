"""`toolkit ds-config MODEL ...` writes a DeepSpeed config; `toolkit ds-config check FILE` checks one."""

from __future__ import annotations

import argparse
import json
import sys

from toolkit.atomic import write_file
from toolkit.errors import ConfigError

BUILD_HELP = """\
Write a DeepSpeed JSON config for a model on a cluster. DP = GPUs / (TP x PP); the three batch keys
are emitted consistent for that DP, which is what DeepSpeed checks when given an mpu. Values whose
default changed between DeepSpeed releases are pinned; bucket sizes come from the hidden size.

Schedules:
  deepspeed  DeepSpeed runs the micro-batches (plain DeepSpeed, HF users): accumulation = global /
             (micro x DP)
  megatron   megatron-core's pipeline schedule runs them (the toolkit's fine-tuning recipe):
             DeepSpeed sees one step per global batch (accumulation 1, micro-batch x micro-batches
             per step, managed_gradient_accumulation false)

Check any config with: toolkit ds-config check FILE [--gpus N --tp T --pp P]
"""

CHECK_HELP = """\
Check a DeepSpeed JSON (ours or hand-written) before a job queues: every key against the keys
DeepSpeed reads (it silently ignores unknown top-level keys and typos in plain blocks), types the
way its pydantic models check them, the batch arithmetic for the data-parallel size, and the
PP/ZeRO, precision, offload, optimizer and scheduler rules. Exits 1 if there are errors.
"""

SCHEDULER_NAMES = {"cosine": "WarmupCosineLR", "linear": "WarmupDecayLR", "constant": "WarmupLR", "none": None}
DEFAULT_LR = 1e-5


class OneLineErrors(argparse.ArgumentParser):
    """Usage errors as one line, like every other error of the toolkit (argparse prints the usage too)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def register(sub) -> None:
    # Two command lines share one name, so this parser takes the rest of argv as it is ("+" as its
    # option prefix keeps argparse from reading -h or --gpus here) and _dispatch picks the parser.
    p = sub.add_parser("ds-config", add_help=False, prefix_chars="+", help="write or check a DeepSpeed config",
                       usage="toolkit ds-config MODEL --gpus N [options]\n       toolkit ds-config check FILE [options]")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=_dispatch)


def _dispatch(args) -> int:
    if args.argv[:1] == ["check"]:
        return _check(check_parser().parse_args(args.argv[1:]))
    return _build(build_parser().parse_args(args.argv))


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="toolkit ds-config", description=BUILD_HELP,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model directory, config.json, or a checkpoint written by `toolkit convert`")
    add_cluster_args(p)
    add_training_args(p)
    _add_optimizer_args(p)
    _add_output_args(p)
    return p


DEFAULT_SEQ_LEN = 4096


def sequence_length(given: int | None, spec) -> int:
    """--seq-len, or the model's longest (at most DEFAULT_SEQ_LEN); never beyond what the model takes."""
    if given is None:
        return min(DEFAULT_SEQ_LEN, spec.max_position_embeddings)
    if not 1 <= given <= spec.max_position_embeddings:
        raise ConfigError(f"--seq-len {given} is outside 1..{spec.max_position_embeddings} (the model's "
                          "max_position_embeddings)")
    return given


def add_cluster_args(p, layout: bool = True) -> None:
    p.add_argument("--gpus", type=int, help="total GPU count (or --nodes x --gpus-per-node)")
    p.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    if layout:
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
        p.add_argument("--vpp", type=int, default=1,
                       help="virtual stages per pipeline rank, megatron-core's interleaved 1F1B (default 1)")


def add_training_args(p) -> None:
    """ZeRO, offload, precision, batch and schedule: what both the config and the memory depend on."""
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default 1)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none")
    p.add_argument("--nvme-path", help="directory on a local NVMe drive, for nvme offload")
    prec = p.add_argument_group("precision (one of)")
    for flag in ("bf16", "fp16", "fp32", "fp8"):  # fp8: bf16 weights, FP8 GEMMs (DeepSpeed's bf16 block)
        prec.add_argument(f"--{flag}", dest="precisions", action="append_const", const=flag, default=[])
    p.add_argument("--micro-batch", type=int, default=1, help="samples per GPU per forward/backward (default 1)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step over all GPUs (default micro x DP)")
    p.add_argument("--schedule", choices=("deepspeed", "megatron"), default="deepspeed",
                   help="who runs the micro-batches (default deepspeed; the toolkit recipe uses megatron)")
    p.add_argument("--overlap-comm", choices=("on", "off"),
                   help="ZeRO's overlap of gradient reduction with backward (default: on at ZeRO-2/3, off at ZeRO-1)")
    p.add_argument("--reduce-bucket-size", type=int, help="elements per ZeRO reduce bucket (default: sized from the model)")


def _add_optimizer_args(p) -> None:
    g = p.add_argument_group("optimizer and LR schedule")
    g.add_argument("--optimizer", default="AdamW", help="DeepSpeed or torch.optim optimizer (default AdamW)")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULT_LR:g})")
    g.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    g.add_argument("--eps", type=float, default=1e-8)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--torch-adam", action="store_true", help="torch.optim.AdamW instead of FusedAdam (no JIT build)")
    g.add_argument("--scheduler", choices=tuple(SCHEDULER_NAMES),
                   help="LR schedule (default: cosine with --total-steps, else a constant LR after any warmup)")
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--total-steps", type=int, help="optimizer steps of the whole run (needed to decay the LR)")
    g.add_argument("--min-lr-ratio", type=float, default=0.0, help="final LR / peak LR for cosine (default 0)")
    g.add_argument("--gradient-clipping", type=float, default=1.0, help="max grad norm, 0 = off (default 1.0)")


def _add_output_args(p) -> None:
    g = p.add_argument_group("monitoring and output")
    g.add_argument("--tensorboard", metavar="DIR", help="emit DeepSpeed's tensorboard monitor block")
    g.add_argument("--csv", metavar="DIR", help="emit DeepSpeed's csv_monitor block")
    g.add_argument("--wandb-project", help="emit DeepSpeed's wandb block (not with --schedule megatron)")
    g.add_argument("--wandb-group")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="emit DeepSpeed's activation_checkpointing block (for models using deepspeed.checkpointing)")
    g.add_argument("--hf-trainer", action="store_true",
                   help="\"auto\" values for the HF Trainer / Accelerate to fill in (data parallel only)")
    g.add_argument("--accelerate-yaml", metavar="FILE", help="also write an Accelerate config pointing at -o")
    g.add_argument("-o", "--output", help="write here (default: stdout)")


def check_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="toolkit ds-config check", description=CHECK_HELP)
    p.add_argument("file", help="DeepSpeed JSON config")
    add_cluster_args(p)
    p.add_argument("--hf-trainer", action="store_true",
                   help="fill \"auto\" with the HF Trainer's and Accelerate's own code, then check what DeepSpeed gets")
    return p


def precision_from_flags(flags: list[str]) -> str:
    from toolkit.dsconfig import rules

    problem = rules.precision(sorted(set(flags)))
    if problem:
        raise ConfigError(problem)
    if len(set(flags)) > 1:
        raise ConfigError(f"choose one precision (got {', '.join(sorted(set(flags)))})")
    return flags[0] if flags else "bf16"


def total_gpus(args) -> int | None:
    for flag in ("--gpus", "--nodes", "--gpus-per-node"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: give at least 1")
    if args.nodes is not None:
        if args.gpus is not None and args.gpus != args.nodes * args.gpus_per_node:
            raise ConfigError(f"--gpus {args.gpus} != --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node}")
        return args.nodes * args.gpus_per_node
    return args.gpus


def training_setup(args, **more):
    """Setup from add_cluster_args + add_training_args flags (more: the remaining Setup fields)."""
    from toolkit.dsconfig import Setup

    gpus = total_gpus(args)
    if gpus is None:
        raise ConfigError("give --gpus N, or --nodes N (with --gpus-per-node)")
    return Setup(
        gpus=gpus, tp=args.tp, pp=args.pp, vpp=getattr(args, "vpp", 1), zero=args.zero, precision=precision_from_flags(args.precisions),
        micro_batch=args.micro_batch, global_batch=args.global_batch,
        offload_optimizer=args.offload_optimizer, offload_param=args.offload_param, nvme_path=args.nvme_path,
        schedule=args.schedule, overlap_comm=None if args.overlap_comm is None else args.overlap_comm == "on",
        reduce_bucket_size=args.reduce_bucket_size, **more)


def _setup(args):
    from toolkit.dsconfig import Monitoring, OptimizerSettings

    lr = DEFAULT_LR if args.lr is None else args.lr
    return training_setup(
        args, activation_checkpointing=args.activation_checkpointing,
        gradient_clipping=args.gradient_clipping, hf_trainer=args.hf_trainer,
        optimizer=OptimizerSettings(args.optimizer, lr, tuple(args.betas), args.eps, args.weight_decay,
                                    args.torch_adam),
        scheduler=_scheduler(args),
        monitoring=Monitoring(args.tensorboard, args.csv, args.wandb_project, args.wandb_group),
    )


def _scheduler(args):
    """No --total-steps: nothing to decay towards, so a constant LR (after any warmup), never a
    made-up step count."""
    from toolkit.dsconfig import SchedulerSettings

    name = args.scheduler or ("cosine" if args.total_steps else "constant")
    kind = SCHEDULER_NAMES[name]
    if kind is None or kind == "WarmupLR" and not args.warmup_steps:
        return None  # the optimizer's LR, unchanged
    return SchedulerSettings(kind, args.warmup_steps, args.total_steps, args.min_lr_ratio)


def _summary(args, setup) -> str:
    from toolkit.dsconfig.build import lr_summary

    line = (f"TP {setup.tp} x PP {setup.pp} x DP {setup.dp}, ZeRO-{setup.zero}, {setup.precision}, "
            f"{setup.micro_batches} micro-batch(es) of {setup.micro_batch} per step; {lr_summary(setup)}")
    if setup.hf_trainer:
        return line
    unasked = [text for value, text in ((args.lr, "--lr not given: the default"),
                                        (args.total_steps, "no --total-steps, so no decay schedule")) if value is None]
    return line + (f" ({'; '.join(unasked)})" if unasked else "")


def _build(args) -> int:
    from toolkit import modelspec
    from toolkit.dsconfig import build

    setup = _setup(args)
    config = build(setup, modelspec.read(args.model))
    text = json.dumps(config, indent=2) + "\n"
    if args.output:
        write_file(args.output, text, args.model)
        print(f"wrote {args.output}: {_summary(args, setup)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(_summary(args, setup), file=sys.stderr)
    if args.accelerate_yaml:
        _write_accelerate(args, setup)
    return 0


def _write_accelerate(args, setup) -> None:
    from toolkit.dsconfig.accelerate import accelerate_yaml

    if not args.output:
        raise ConfigError("--accelerate-yaml needs -o: the Accelerate config points at the JSON file")
    nodes = max(1, setup.gpus // args.gpus_per_node)
    write_file(args.accelerate_yaml, accelerate_yaml(args.output, setup.gpus, nodes, setup.zero), args.output, args.model)
    print(f"wrote {args.accelerate_yaml}", file=sys.stderr)


def _check(args) -> int:
    from toolkit.dsconfig import check
    from toolkit.runtime.distributed import deepspeed_cpu_accelerator

    # Only DeepSpeed's config models are used; don't let it probe for (and warn about) a GPU.
    with deepspeed_cpu_accelerator():
        report = check(args.file, gpus=total_gpus(args), tp=args.tp, pp=args.pp, hf_trainer=args.hf_trainer)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1
