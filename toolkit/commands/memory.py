"""`toolkit memory`: per-GPU memory of one layout, stage by stage, and whether it fits."""

from __future__ import annotations

DESCRIPTION = """\
Estimate memory per GPU for one TP x PP x DP x ZeRO layout: parameters, gradients and optimizer
states (as DeepSpeed allocates them), activations per pipeline stage (1F1B keeps up to PP
micro-batches in flight on the first stage), buffers, and host memory when offloading. With
--gpu-memory it says whether the layout fits and, if not, what would (see `toolkit plan`).
"""


def register(sub) -> None:
    import argparse

    from toolkit.commands.ds_config import add_cluster_args, add_training_args

    p = sub.add_parser("memory", help="per-GPU memory estimate of one layout", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model directory, config.json, or a converted checkpoint")
    add_cluster_args(p)
    add_training_args(p)
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron sequence parallelism (TP > 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism of an MoE model (the recipe's parallel.ep; divides DP and the experts)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism (the recipe's parallel.cp): each sequence split over CP of the DP ranks")
    p.add_argument("--kernels", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: Transformer Engine kernels (default); cpu: megatron-core's local spec")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GiB: say whether the layout fits")
    add_lora_args(p)
    add_dp_engine_arg(p)
    p.set_defaults(func=_run)


def add_dp_engine_arg(p) -> None:
    p.add_argument("--dp-engine", choices=("deepspeed", "fsdp"), default="deepspeed",
                   help="data parallelism: DeepSpeed ZeRO (--zero), or PyTorch FSDP2 (the recipe's "
                        "parallel.dp_engine=fsdp: PP 1, bf16/fp32, fp32 masters sharded over DP)")


def add_lora_args(p) -> None:
    g = p.add_argument_group("LoRA (the base frozen: weights only; the adapter trained)")
    g.add_argument("--lora-r", type=int, help="LoRA rank: estimate a LoRA fine-tune instead of a full one")
    g.add_argument("--lora-targets", nargs="+", default=["all-linear"],
                   help="PEFT target module names, e.g. q_proj v_proj (default all-linear)")


def lora_shape(args, spec):
    """toolkit.memory.lora.LoraShape from --lora-r / --lora-targets, checked against the model."""
    from toolkit.memory.lora import LoraShape

    if args.lora_r is None:
        return None
    lora = LoraShape(args.lora_r, tuple(args.lora_targets))
    lora.linears(spec)  # refuses a target the family lacks, or r out of range
    return lora


def _run(args) -> int:
    from dataclasses import replace

    from toolkit import modelspec
    from toolkit.commands.ds_config import sequence_length, training_setup
    from toolkit.memory import CPU_LOCAL, GPU, estimate
    from toolkit.units import parse_size, size

    setup = training_setup(args)
    if args.cp > 1 and setup.global_batch is not None:  # DeepSpeed's view: each CP rank's share counts as a sample
        setup = replace(setup, global_batch=setup.global_batch * args.cp)
    spec = modelspec.read(args.model)
    args.seq_len = sequence_length(args.seq_len, spec)
    args.lora = lora_shape(args, spec)
    est = estimate(spec, setup, args.seq_len, args.recompute, GPU if args.kernels == "gpu" else CPU_LOCAL,
                   args.sequence_parallel, lora=args.lora, ep=args.ep, dp_engine=args.dp_engine, cp=args.cp)
    lora = f", LoRA r={args.lora.r} on {' '.join(args.lora.target_modules)}" if args.lora else ""
    ep = f" (EP {args.ep})" if args.ep > 1 else ""
    ep += f" (DP {setup.dp // args.cp} x CP {args.cp})" if args.cp > 1 else ""
    engine = "FSDP" if args.dp_engine == "fsdp" else f"ZeRO-{setup.zero}"
    print(f"TP {setup.tp} x PP {setup.pp} x DP {setup.dp}{ep}, {engine}, {setup.precision}, micro-batch "
          f"{setup.micro_batch} x {setup.micro_batches} per step, sequence {args.seq_len}, recompute {args.recompute}{lora}")
    print("\n".join(est.table(args.gpus_per_node)))
    if not args.gpu_memory:
        return 0
    limit = parse_size(args.gpu_memory)
    if est.fits(limit):
        print(f"fits: {size(est.gpu_bytes)} of {size(limit)} on the fullest GPU (stage {est.peak.stage})")
        return 0
    print(f"does not fit: {size(est.gpu_bytes)} > {size(limit)} on stage {est.peak.stage}")
    _suggest(spec, setup, args, limit)
    return 1


def _suggest(spec, setup, args, limit) -> None:
    from toolkit.memory import CPU_LOCAL, GPU, estimate
    from toolkit.plan import Cluster, plan
    from toolkit.units import size

    kernels = GPU if args.kernels == "gpu" else CPU_LOCAL
    for recompute in ("selective", "full")[("none", "selective", "full").index(args.recompute):]:
        est = estimate(spec, setup, args.seq_len, recompute, kernels, args.sequence_parallel, lora=args.lora,
                       ep=args.ep, dp_engine=args.dp_engine, cp=args.cp)
        if est.fits(limit):
            print(f"note: the same layout fits with --recompute {recompute} ({size(est.gpu_bytes)})")
            return
    result = plan(spec, Cluster(setup.gpus, limit, args.gpus_per_node), args.seq_len, setup.samples_per_step // args.cp,
                  setup.precision, setup.schedule, lora=args.lora, dp_engine=args.dp_engine)
    for line in result.advice:
        print(f"note: {line}")
    if result.best is not None:
        print(f"note: best fitting layout: {result.best.explain(result.cluster)}")
