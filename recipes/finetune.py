"""3D-parallel fine-tuning: megatron-core TP/PP + DeepSpeed ZeRO data parallelism.

    deepspeed --num_gpus 4 recipes/finetune.py --config recipes/tiny-cpu.yaml [key.sub=value ...]
    torchrun --nproc_per_node 4 recipes/finetune.py --config recipes/tiny-cpu.yaml
    srun ... torchrun ... recipes/finetune.py ...             (see toolkit slurm)

Who owns what:
  megatron-core  tensor-parallel layers (GPTModel), sequence parallelism and the pipeline schedule
                 (1F1B, or interleaved over virtual stages with parallel.vpp)
  DeepSpeed      data parallelism (ZeRO; experts over megatron-core's expert-DP group), precision,
                 the optimizer step, checkpoint files
  PyTorch FSDP2  instead of DeepSpeed with parallel.dp_engine=fsdp (PP = 1): sharding over DP,
                 bf16 mixed precision, torch AdamW, torch.distributed.checkpoint (toolkit.train.fsdp)
  this recipe    the loss normalisation, padded-vocab masking, tied-embedding gradients, the TP sum
                 of gradients megatron-core leaves partial (sequence-parallel norms, q/k norms),
                 data order, checkpoint markers, metrics and the export to HF
  toolkit.lora    with peft.enabled=true: LoRA around megatron-core's linears, the base frozen
                 (applied in step 3b), the adapter saved and exported as an HF PEFT directory
  toolkit.vlm    a vision-language checkpoint (Qwen3-VL): transformers' vision tower on the first stage,
                 images read by the model's processor (toolkit.train.image_rows), vlm.freeze (step 3)
  method=dpo     preference pairs (toolkit.train.preference) and TRL's DPO losses and metrics
                 (toolkit.train.preference_loss) against a frozen reference (toolkit.train.reference,
                 step 3c), whose log-probs a forward-only pass computes before each step
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (recipes/*.yaml)")
    parser.add_argument("--verbose", action="store_true", help="show third-party warnings (DeepSpeed, megatron-core, ...)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # appended by `deepspeed`
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. optim.lr=1e-4 parallel.tp=2")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from toolkit.runtime.launcher_watch import exit_with_launcher, launcher_hint, under_launcher

    if not under_launcher():
        print(f"error: {launcher_hint(sys.argv)}", file=sys.stderr, flush=True)
        return 2
    exit_with_launcher()  # the ranks end with their launcher (kill -9 included), freeing MASTER_PORT
    from toolkit.runtime.distributed import choose_deepspeed_accelerator
    from toolkit.runtime.quiet import quiet_third_party

    quiet_third_party(args.verbose)
    choose_deepspeed_accelerator()
    from toolkit.errors import ReportedByAnotherRank, ToolkitError

    rank = int(os.environ.get("RANK", "0"))
    try:
        run = prepare(args.config, args.overrides)
    except ToolkitError as e:
        # Every rank reaches the same verdict before any process group exists: rank 0 says it once,
        # and the others wait a moment so that the launcher doesn't stop rank 0 before it has.
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(3)
        return 2
    from torch.distributed import DistNetworkError

    try:
        return finetune(run)
    except ReportedByAnotherRank:  # another rank said it in one line
        return 2
    except ToolkitError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 2
    except DistNetworkError as e:  # e.g. MASTER_PORT still held by an earlier run's processes
        from toolkit.runtime.distributed import network_error_line

        print(f"error (rank {rank}): {network_error_line(e)}", file=sys.stderr, flush=True)
        return 2


@dataclass
class Run:
    """What `prepare` checked and read: everything a run needs that no process group does."""

    cfg: object
    meta: object
    tokenizer: object
    dp: int
    layout_key: dict
    schedule: object
    resume_from: Path | None
    lora: object  # toolkit.train.build.LoraPlan, or None for a full fine-tune
    same_layout: bool  # the resume point was written on this layout (else: its layout-independent state)
    optimizer_start: object  # toolkit.train.megatron_optimizer.MegatronOptimizerState (model.optimizer_state)
    data: object  # toolkit.train.recipe_data.DataRows: read and checked before the model is built
    wrapper: Path | None  # a vision-language checkpoint's published one (tower, processor); None for a text model


def prepare(config_path, overrides) -> Run:
    """1. Config, checkpoint, tokenizer, layout, run directory, resume point and data (read, tokenized
    and checked): every check that needs no processes, so a mistake is one line before any rank
    starts working and before the model is built."""
    from toolkit.train import build, checkpoint, megatron_optimizer, recipe_data
    from toolkit.train.config import load_config
    from toolkit.train.schedule import LRSchedule

    from toolkit.runtime.distributed import check_node_gpus

    check_node_gpus()  # one GPU per local rank
    cfg = load_config(config_path, overrides)
    meta = build.read_checkpoint_meta(cfg)
    tokenizer = recipe_data.load_tokenizer(cfg)
    dp = build.check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")), meta)
    fsdp = cfg.parallel.dp_engine == "fsdp"
    layout_key = {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp,
                  "zero_stage": None if fsdp else cfg.parallel.zero_stage, "vpp": cfg.parallel.vpp,
                  **({"ep": cfg.parallel.ep} if meta.model_spec.is_moe else {}), **({"dp_engine": "fsdp"} if fsdp else {}),
                  **({"cp": cfg.parallel.cp} if cfg.parallel.cp > 1 else {})}
    run_dir = Path(cfg.run_dir)
    checkpoint.refuse_outputs_over_inputs(run_dir, cfg.model.checkpoint, *cfg.data.train_file.split(","),
                                          cfg.data.valid_file, cfg.model.optimizer_state)
    checkpoint.refuse_used_run_dir(run_dir, cfg.resume)
    # A damaged latest checkpoint falls back to the newest intact one, said once (by rank 0).
    # Each checked once: its train_state.json and train/ index are read here and passed along.
    checked = checkpoint.find_resumable(run_dir, say=print if os.environ.get("RANK", "0") == "0" else lambda _: None) \
        if cfg.resume == "auto" else (checkpoint.refuse_damaged(cfg.resume) if cfg.resume != "none" else None)
    resume_from = checked.path if checked is not None else None
    schedule = LRSchedule.from_config(cfg)
    lora = build.lora_plan(cfg, meta)
    same_layout = checked is None or checkpoint.check_resumable(checked, layout_key, schedule, meta, cfg.global_batch,
                                                                lora is not None, cfg.model.checkpoint)
    # A fresh run may start from a Megatron-LM run's Adam state; a resume has its own in train/.
    optimizer_start = None
    if cfg.model.optimizer_state is not None and resume_from is None:
        optimizer_start = megatron_optimizer.check(cfg.model.optimizer_state, meta, cfg.parallel.tp,
                                                   keep_step=cfg.model.optimizer_step == "keep")
    wrapper = build.vision_language_wrapper(cfg, meta)
    data = recipe_data.read_data(cfg, tokenizer, wrapper)
    return Run(cfg, meta, tokenizer, dp, layout_key, schedule, resume_from, lora, same_layout, optimizer_start, data,
               wrapper)


def finetune(run: Run) -> int:
    import torch.distributed as dist

    from toolkit.model import layer_spec_choice
    from toolkit.runtime.distributed import init_parallel, shutdown
    from toolkit.train import build, checkpoint, loss_scale, megatron_optimizer
    from toolkit.train.loss import padded_vocab_mask
    from toolkit.train.metrics import CPU_SOURCE, MetricsLogger, flops_per_token, peak_memory_bytes, peak_tflops
    from toolkit.train.progress import Progress
    from toolkit.train.parallel import build_engine, mark_tied_output_replica, sum_partial_grads_over_tp
    from toolkit.train.preemption import PREEMPTED_EXIT_CODE, PreemptionFlag
    from toolkit.train.schedule import LRSchedule
    from toolkit.train.elastic import ParamShards
    from toolkit.train.fsdp import build_engine as fsdp_engine
    from toolkit.train.expert_load import ExpertLoad
    from toolkit.train.step import StepContext, evaluate, train_step
    from toolkit.train.generations import TABLE_KEY, prompts_of, sample_rows, wandb_table
    from toolkit.lora.layers import keep_starting_adapter
    from toolkit.train.preference_loss import DpoObjective, named_metrics
    from toolkit.train.reference import Reference

    cfg, meta, dp, run_dir = run.cfg, run.meta, run.dp, Path(run.cfg.run_dir)
    spec = meta.model_spec
    preemption = PreemptionFlag()  # SIGUSR1 / SIGTERM: checkpoint after the current step, then exit

    # 2. Distributed: torch.distributed (NCCL or gloo) and megatron-core's TP/PP/DP (and EP) groups, the
    #    experts' TP groups of the TP the model is built with (1 where its experts have biases: the MoE
    #    layers take their groups from parallel_state, not from the config's expert_tensor_parallel_size).
    info = init_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, ep=cfg.parallel.ep, vpp=cfg.parallel.vpp,
                         cp=cfg.parallel.cp, etp=spec.expert_tp(cfg.parallel.tp))
    peak, peak_source = peak_tflops(cfg.peak_tflops, cfg.precision)
    progress = Progress(info.rank == 0, cfg.steps, show_mfu=peak_source != CPU_SOURCE)
    cp_named = f" x CP {info.cp}" if info.cp > 1 else ""
    progress.stage(f"building the model (TP {info.tp} x PP {info.pp}{cp_named} x DP {info.dp}) and loading its weights "
                   f"from {cfg.model.checkpoint}")

    # 3-4. Model on this rank's pipeline stage, with its TP shard of the converted weights (a vision-language
    #      checkpoint's: with the vision tower on the first stage, vlm.freeze's parts frozen).
    model, layout = build.build_model(meta, cfg, run.wrapper)
    if info.rank == 0:
        print("layer spec: {} ({})".format(*layer_spec_choice(cfg.peft.enabled, spec)), flush=True)
        if cfg.precision == "fp8":
            print(build.fp8_line(cfg, spec), flush=True)
    # 3b. LoRA (peft.enabled): the base frozen and the targeted linears wrapped, here and only
    #     here, before DeepSpeed sees the parameters, so that it optimizes the adapter alone.
    adapter = build.apply_lora(model, run.lora, meta, layout, info, cfg.seed) if run.lora else None
    # 3c. method=dpo: the reference, a frozen copy of the starting weights sharded like the policy,
    #     or with LoRA the policy with its adapter off (from peft.init_from: with the adapter it starts from).
    reference = None
    if cfg.method == "dpo":
        if adapter is not None and run.lora.init_from is not None:
            keep_starting_adapter(model)
        reference = Reference.build(model, meta, cfg, lora=adapter is not None)
    fsdp = cfg.parallel.dp_engine == "fsdp"
    mark_tied_output_replica(model, spec.tied_embeddings)
    if not fsdp:  # FSDP replaces the parameters; toolkit.train.fsdp sums these after its reduce-scatter
        sum_partial_grads_over_tp(model)

    # 5. Data (read in step 1): this DP rank's share of every global batch, in a deterministic order.
    progress.stage("dealing out the data to the data-parallel ranks")
    train_data, valid_data, data_stats = build.build_data(cfg, info, run.data)
    num_microbatches = train_data.num_microbatches

    # 6. DeepSpeed engine: ZeRO, precision, AdamW and the LR schedule. Each parameter's global
    #    sharding is read first (ZeRO-3 empties the parameters): checkpoints use it for any layout.
    #    parallel.dp_engine=fsdp: PyTorch FSDP2 over DP and torch's AdamW instead (toolkit.train.fsdp).
    shards = ParamShards(model) if adapter is None and not fsdp else None  # an adapter resumes on its own layout only
    progress.stage("building the FSDP engine" if fsdp else f"building the DeepSpeed engine (ZeRO-{cfg.parallel.zero_stage})")
    if fsdp:
        ds_config, engine = None, fsdp_engine(model, cfg, run.schedule)
    else:
        ds_config = build.ds_config(cfg, spec, dp)
        engine = build_engine(model, cfg, ds_config, run.schedule)
    # fp16: megatron-core's backward scales the loss by DeepSpeed's dynamic loss scale (toolkit.train.loss_scale).
    fp16_watch = loss_scale.wire(engine, model, cfg) if cfg.precision == "fp16" else None

    # 7. Resume (weights, optimizer, LR schedule, data position; RNG on the same layout) if asked,
    #    from DeepSpeed's files on the same layout, else from the layout-independent state. Or, with
    #    model.optimizer_state, start from a Megatron-LM run's fp32 masters and Adam moments (LR
    #    schedule and data from the start: it is a new fine-tune).
    start_step = 0
    if run.resume_from is not None:
        progress.stage(f"resuming from {run.resume_from}")
        start_step = checkpoint.resume(run.resume_from, engine, train_data, run.schedule, LRSchedule.from_config(cfg),
                                       shards, run.same_layout, lora=adapter is not None)
    elif run.optimizer_start is not None:
        megatron_optimizer.load(run.optimizer_start, engine, shards)

    resolved = {"config": cfg.to_dict(), "layout": {**run.layout_key, "world_size": info.world_size,
                "num_microbatches": num_microbatches}, "deepspeed": ds_config, "data": data_stats.summary()}
    logger = MetricsLogger(run_dir, info.rank == 0, cfg.wandb, resolved, start_step)
    if info.rank == 0:
        (run_dir / "resolved_config.json").write_text(json.dumps(resolved, indent=2, default=str))
        print(f"resolved layout {resolved['layout']}; data {resolved['data']}; resuming at step {start_step}", flush=True)

    vocab_mask = padded_vocab_mask(spec.vocab_size, layout.padded_vocab(spec.vocab_size), cfg.parallel.tp, info.tp_rank, info.device)
    padded_tokens = cfg.global_batch * cfg.data.seq_len
    model_length = build.model_length(cfg)  # data.seq_len, padded under CP to the zig-zag split's multiple

    objective = DpoObjective.from_config(cfg) if reference is not None else None
    inputs = build.model_inputs(run.wrapper)  # what a micro-batch becomes on the way to the model (images, or not)
    rows_per_pair = 2 if reference is not None else 1  # a pair is two rows of one micro-batch

    def context(batches, counts):
        return StepContext(len(batches), dp, counts.loss_tokens, vocab_mask, model_length, cfg.micro_batch * rows_per_pair,
                           counts.real_tokens, spec.is_moe, cfg.parallel.sequence_parallel, objective,
                           hybrid=spec.hybrid_pattern is not None, inputs=inputs)

    # wandb.sample_generations: the validation prompts greedily continued at each eval (PP = 1).
    samples = prompts_of(valid_data.rows, cfg.wandb.sample_generations) \
        if valid_data is not None and cfg.wandb.sample_generations else []

    # Tokens per expert per layer (the load balance), logged with the other metrics.
    expert_load = ExpertLoad(model, spec.num_layers, spec.num_experts) if spec.is_moe else None

    # 8. The loop.
    progress.begin(start_step)
    for step in range(start_step + 1, cfg.steps + 1):
        batches = train_data.next_global_batch()
        lr = engine.get_lr()[0]
        began = time.perf_counter()
        ctx = context(batches, train_data.last_counts)
        if reference is not None:
            reference.attach(batches, ctx)  # the reference's log-probs, one forward-only pass
        loss, grad_norm, stop = train_step(engine, model, batches, ctx, spec.tied_embeddings,
                                           lambda: preemption.requested)
        seconds = time.perf_counter() - began
        # Throughput counts real (non-padding) tokens; the padded figure is labelled as such.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": ctx.real_tokens / seconds,
                   "padded_tokens_per_s": padded_tokens / seconds,
                   "tflops_per_device": flops_per_token(spec, cfg.data.seq_len) * ctx.real_tokens / seconds / info.world_size / 1e12}
        metrics["mfu"] = metrics["tflops_per_device"] / peak if peak else None
        if reference is not None:  # TRL's rewards/* and logps/*, means over the global batch's pairs
            metrics.update(named_metrics(ctx.sums, ctx.global_tokens))
        metrics["peak_memory_bytes"] = peak_memory_bytes(info.device)  # rank 0's, as every figure logged here
        if fp16_watch is not None:
            metrics.update(fp16_watch.after_step(step))  # loss scale, skipped steps; stops after too many in a row
        media = {}
        if valid_data is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            if reference is None:
                metrics["eval_loss"] = evaluate(model, valid_data, context)
            else:
                metrics["eval_loss"], sums = evaluate(model, valid_data, context, reference)
                metrics.update(named_metrics(sums, 1.0, prefix="eval_"))
            if samples:  # every rank decodes (TP gathers, ZeRO-3 / FSDP gathers); rank 0 logs
                rows = sample_rows(model, samples, step, run.tokenizer, cfg.wandb.sample_new_tokens, cfg.data.seq_len,
                                   spec.vocab_size, info.device)
                media[TABLE_KEY] = wandb_table(rows) if logger.wandb is not None else None
        # an eval step with a samples table is always logged: the table exists at eval steps only
        log_now = step % cfg.log_every == 0 or step == cfg.steps or step == start_step + 1 or bool(media)
        if expert_load is not None:
            metrics["tokens_per_expert"] = expert_load.take(info.device) if log_now else expert_load.reset()
        if log_now:
            logger.log(step, metrics, media)
        progress.step(step, metrics, log_now)
        if stop or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            train_state = {**run.layout_key, "global_batch": cfg.global_batch, "seq_len": cfg.data.seq_len,
                           "lr_schedule": run.schedule.state()}
            saving = time.perf_counter()
            saved = checkpoint.save(run_dir, step, engine, model, shards, train_data, train_state, meta,
                                    cfg.model.checkpoint, cfg.keep_last, adapter)
            progress.saved(step, saved, time.perf_counter() - saving)
        if stop:
            if info.rank == 0:
                print(f"{preemption.signal_name or 'signal'} received: saved step {step}, exiting for requeue", flush=True)
            progress.close()
            logger.close()
            shutdown()
            return PREEMPTED_EXIT_CODE

    # 9. Export the final fp32 master weights to HF (cast to the source dtype), or with LoRA the
    #    adapter as an HF PEFT directory; also after a requeue that found the last step already
    #    saved but not yet exported.
    if adapter is not None and info.rank == 0:
        from toolkit.convert.metadata import HF_DIR

        checkpoint.export_adapter(run_dir, Path(cfg.model.checkpoint) / HF_DIR)
        print(f"exported the LoRA adapter to {run_dir / checkpoint.ADAPTER_EXPORT}", flush=True)
    elif cfg.export_hf and info.rank == 0 and (cfg.steps > start_step or not (run_dir / checkpoint.HF_EXPORT).exists()):
        from toolkit.convert import megatron_to_hf

        # into a vision-language checkpoint's published one (its tower as published: a trained tower is refused)
        megatron_to_hf(checkpoint.find_latest(run_dir) / "model", run_dir / checkpoint.HF_EXPORT, overwrite=True, progress=False,
                       wrapper=run.wrapper)
        print(f"exported HF model to {run_dir / 'hf'} (peak FLOP/s reference: {peak_source})", flush=True)
    progress.close()
    logger.close()
    dist.barrier()
    shutdown()
    return 0


if __name__ == "__main__":  # required: dist-checkpoint saves spawn a manager that re-imports __main__
    raise SystemExit(main())
