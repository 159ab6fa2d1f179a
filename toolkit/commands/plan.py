"""`toolkit plan`: rank the TP x PP x DP x ZeRO layouts that fit a model on a GPU budget, and write
the best one as a bundle that runs (toolkit.plan_bundle)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.memory import GIB

DESCRIPTION = """\
Enumerate valid (TP, PP, DP, ZeRO, offload, micro-batch, recompute) layouts, drop those whose
estimated per-GPU memory (model states + activations + buffers + a 2 GiB runtime reserve)
exceeds --gpu-memory, and rank the rest by a simple throughput model (TP inside a node, PP
across nodes, pipeline bubble (PP-1)/(m+PP-1), DP/ZeRO traffic, offload over PCIe). One line per
layout says why. When nothing fits, it says what would (offload, more GPUs, recompute).

With -o DIR, the best layout the recipe runs is written there as a bundle: DIR/recipe.yaml (the
layout in the recipe's keys, with the model and --data paths), DIR/job.sbatch (what `toolkit slurm
render` writes for it) and DIR/PLAN.md (the ranked table, why this layout, its memory per GPU and
the DeepSpeed config recipes/finetune.py builds from the recipe). Without -o nothing is written.

  toolkit plan --model MODEL --gpus 8 --gpu-memory 80GiB --data train.jsonl -o plan-8gpu
  deepspeed --num_gpus 8 recipes/finetune.py --config plan-8gpu/recipe.yaml
"""


def register(sub) -> None:
    from toolkit.commands.ds_config import add_cluster_args
    from toolkit.commands.memory import add_dp_engine_arg, add_lora_args
    from toolkit.plan import CP_MIN_SEQ, MAX_CP, RECOMPUTE

    p = sub.add_parser("plan", help="rank the 3D layouts that fit a model on a GPU budget",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory, config.json, or a converted checkpoint")
    add_cluster_args(p, layout=False)
    p.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB")
    p.add_argument("--host-memory", help="host memory per node, e.g. 2TiB (limits offload; default: unlimited)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 4 x GPUs, at least 64)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default="bf16",
                   help="fp8: bf16 weights, FP8 GEMMs; memory priced as Transformer Engine keeps it, step time as bf16's")
    p.add_argument("--schedule", choices=("megatron", "deepspeed"), default="megatron",
                   help="schedule mode of the written config (default megatron, the toolkit's recipe)")
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual stages per pipeline rank for layouts with PP > 1 (interleaved 1F1B; default 1)")
    p.add_argument("--no-offload", action="store_true", help="don't consider CPU offload")
    p.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=list(RECOMPUTE), metavar="MODE",
                   help="activation recompute modes to consider, among none, selective, full (default: all three; "
                        "full recompute runs each layer's forward twice)")
    p.add_argument("--max-cp", type=int, default=MAX_CP, metavar="N",
                   help=f"largest context-parallel size (parallel.cp) to consider for sequences of {CP_MIN_SEQ} "
                        f"tokens or more (default {MAX_CP}; 1: no CP)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="write the bundle (recipe.yaml, job.sbatch, PLAN.md) here (default: write nothing)")
    p.add_argument("--data", help="training JSONL for the bundle's recipe (data.train_file)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty -o DIR")
    add_dp_engine_arg(p)
    add_lora_args(p)
    p.add_argument("--dpo", action="store_true", help="price method=dpo: pairs per micro-batch and, for a full "
                   "fine-tune, the frozen reference copy of the weights")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit import modelspec
    from toolkit.commands.ds_config import sequence_length, total_gpus
    from toolkit.commands.memory import lora_shape
    from toolkit.memory.params import active_params, total_params
    from toolkit.plan import Cluster, default_global_batch, plan
    from toolkit.units import gib, parse_size

    gpus = total_gpus(args)
    if gpus is None:
        raise ConfigError("give --gpus N, or --nodes N (with --gpus-per-node)")
    spec = modelspec.read(args.model)
    args.seq_len = sequence_length(args.seq_len, spec)
    cluster = Cluster(gpus, parse_size(args.gpu_memory), args.gpus_per_node,
                      parse_size(args.host_memory) if args.host_memory else None)
    lora = lora_shape(args, spec)
    result = plan(spec, cluster, args.seq_len, args.global_batch, args.precision, args.schedule,
                  allow_offload=not args.no_offload, lora=lora, vpp=args.vpp, dp_engine=args.dp_engine, dpo=args.dpo,
                  recompute=tuple(args.recompute), max_cp=args.max_cp)
    batch = args.global_batch or default_global_batch(gpus)
    active = f" ({active_params(spec) / 1e9:.2f}B active per token)" if spec.is_moe else ""
    print(f"{spec.family} model, {total_params(spec) / 1e9:.2f}B parameters{active}, on {gpus} x {gib(cluster.gpu_memory)} "
          f"({args.gpus_per_node} per node); sequence {args.seq_len}, global batch {batch} sequences")
    for i, candidate in enumerate(result.ranked[:args.top], 1):
        print(f"{i:>3}. {candidate.explain(cluster)}")
    for line in result.advice:
        print(f"note: {line}")
    if result.best is None:
        return 1
    print("\n".join(result.best.memory.table(args.gpus_per_node)))
    if args.output:
        _write(args, spec, result, lora)
    return 0


def _write(args, spec, result, lora) -> None:
    from toolkit import plan_bundle

    out = Path(args.output)
    if args.schedule != "megatron":
        raise ConfigError("-o writes a bundle for recipes/finetune.py, which runs megatron-core's schedule: "
                          "drop --schedule deepspeed")
    paths = plan_bundle.paths_for(args.model, out, args.data)
    plan_bundle.refuse_overlap(paths, out)
    bundle = plan_bundle.make(result, spec, args.seq_len, paths, lora, args.dp_engine, args.dpo)
    command = "toolkit " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else f"toolkit plan --model {args.model} ..."
    plan_bundle.write(bundle, out, command, args.overwrite, args.top)
    s = bundle.candidate.setup
    print(f"wrote {out}/{{{plan_bundle.RECIPE},{plan_bundle.JOB},{plan_bundle.PLAN}}}: TP {s.tp} x PP {s.pp} x DP {s.dp // bundle.memory.cp}, "
          f"ZeRO-{s.zero}, micro_batch {s.micro_batch}, parallel.recompute={bundle.recipe['parallel']['recompute'] or 'null'}"
          + (f", parallel.ep={bundle.memory.ep}" if bundle.memory.ep > 1 else "")
          + (f", parallel.cp={bundle.memory.cp}" if bundle.memory.cp > 1 else "")
          + f", {bundle.memory.gpu_bytes / GIB:.1f} GiB per GPU; run: {plan_bundle.launch_command(bundle, out)}",
          file=sys.stderr)
