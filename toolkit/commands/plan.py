"""`toolkit plan`: rank the TP x PP x DP x ZeRO layouts that fit a model on a GPU budget, and write
the best one's DeepSpeed config."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolkit.errors import ConfigError

DESCRIPTION = """\
Enumerate valid (TP, PP, DP, ZeRO, offload, micro-batch, recompute) layouts, drop those whose
estimated per-GPU memory (model states + activations + buffers + a 2 GiB runtime reserve)
exceeds --gpu-memory, and rank the rest by a simple throughput model (TP inside a node, PP
across nodes, pipeline bubble (PP-1)/(m+PP-1), DP/ZeRO traffic, offload over PCIe). One line per
layout says why. When nothing fits, it says what would (offload, more GPUs, recompute).

With -o FILE, the best layout's DeepSpeed config (megatron-core schedule mode, for the toolkit's
recipe) is written there; without it nothing is written.
"""


def register(sub) -> None:
    from toolkit.commands.ds_config import add_cluster_args
    from toolkit.commands.memory import add_dp_engine_arg, add_lora_args

    p = sub.add_parser("plan", help="rank the 3D layouts that fit a model on a GPU budget",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory, config.json, or a converted checkpoint")
    add_cluster_args(p, layout=False)
    p.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB")
    p.add_argument("--host-memory", help="host memory per node, e.g. 2TiB (limits offload; default: unlimited)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 4 x GPUs, at least 64)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--schedule", choices=("megatron", "deepspeed"), default="megatron",
                   help="schedule mode of the written config (default megatron, the toolkit's recipe)")
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual stages per pipeline rank for layouts with PP > 1 (interleaved 1F1B; default 1)")
    p.add_argument("--no-offload", action="store_true", help="don't consider CPU offload")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("-o", "--output", help="write the best layout's DeepSpeed config here (default: write nothing)")
    add_dp_engine_arg(p)
    add_lora_args(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit import modelspec
    from toolkit.commands.ds_config import sequence_length, total_gpus
    from toolkit.commands.memory import lora_shape
    from toolkit.memory.params import total_params
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
    if args.dp_engine == "fsdp" and args.output:
        raise ConfigError("--dp-engine fsdp with -o: FSDP runs without a DeepSpeed config; run the recipe "
                          "with parallel.dp_engine=fsdp and the layout shown")
    result = plan(spec, cluster, args.seq_len, args.global_batch, args.precision, args.schedule,
                  allow_offload=not args.no_offload, lora=lora, vpp=args.vpp, dp_engine=args.dp_engine)
    batch = args.global_batch or default_global_batch(gpus)
    print(f"{spec.family} model, {total_params(spec) / 1e9:.2f}B parameters, on {gpus} x {gib(cluster.gpu_memory)} "
          f"({args.gpus_per_node} per node); sequence {args.seq_len}, global batch {batch} sequences")
    for i, candidate in enumerate(result.ranked[:args.top], 1):
        print(f"{i:>3}. {candidate.explain(cluster)}")
    for line in result.advice:
        print(f"note: {line}")
    if result.best is None:
        return 1
    print("\n".join(result.best.memory.table(args.gpus_per_node)))
    if args.output:
        _write(Path(args.output), spec, result.best, args.model)
    return 0


def _write(path: Path, spec, best, model: str) -> None:
    from toolkit.atomic import write_file
    from toolkit.dsconfig import build
    from toolkit.dsconfig.build import lr_summary

    write_file(path, json.dumps(build(best.setup, spec), indent=2) + "\n", model)
    s = best.setup
    print(f"wrote {path}: TP {s.tp} x PP {s.pp} x DP {s.dp}, ZeRO-{s.zero}, micro-batch {s.micro_batch}, "
          f"{lr_summary(s)} (a default: plan knows no LR or step count); "
          f"run the recipe with recompute={best.recompute}"
          + (f" parallel.ep={best.memory.ep}" if best.memory.ep > 1 else ""), file=sys.stderr)
