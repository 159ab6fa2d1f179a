"""One optimizer step (and one evaluation pass) through megatron-core's pipeline schedule."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from toolkit.train import loss as loss_lib
from toolkit.train.model_inputs import text_inputs
from toolkit.train.virtual import VirtualStages


@dataclass
class StepContext:
    """What every micro-batch of a step needs to know."""

    num_microbatches: int
    dp: int
    global_tokens: int  # loss tokens of the global batch (the normaliser)
    vocab_mask: torch.Tensor | None
    seq_len: int
    micro_batch: int
    real_tokens: int = 0  # non-padding input tokens of the global batch (throughput)
    moe: bool = False  # Mixture-of-Experts: padding is left out of the router's load-balancing loss
    sequence_parallel: bool = False
    # objective(output, batch, ctx) -> (loss to backpropagate, {"loss_sum": ..., "sums": [k]}); None: the
    # token cross-entropy (toolkit.train.loss). method=dpo: toolkit.train.preference_loss.DpoObjective.
    objective: Callable | None = None
    sums: list[float] | None = None  # after run_schedule: the objective's "sums" over the global batch
    # megatron-core's HybridModel (Nemotron 3's MoE layers), which passes the padding mask on unscattered under sequence
    # parallelism on every stage (0.19.2 hybrid_model.py:508-521, 0.16.1 mamba_model.py:258), where GPTModel scatters it
    # on its first stage (gpt_model.py:352-359)
    hybrid: bool = False
    # inputs(batch, device, ctx) -> (args, kwargs) of the model's forward (toolkit.train.model_inputs)
    inputs: Callable = text_inputs


def reduce_step_totals(loss_sum: torch.Tensor | None, stop_requested: bool, device, width: int = 1):
    """The step's one collective of our own: (sum of the global batch's token losses, whether any
    rank was asked to stop), summed over all ranks at once. Only the last pipeline stage's first TP
    rank holds a loss sum (TP ranks hold the same one); the other ranks add zero. On the compute
    device (NCCL refuses host tensors); one host sync, here, per step. With width > 1, `loss_sum`
    is a vector of that many sums (the first the loss's) and the first item returned is their list."""
    from megatron.core import parallel_state as ps

    totals = torch.zeros(width + 1, dtype=torch.float64, device=device)
    if loss_sum is not None and ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        totals[:width] = loss_sum
    totals[width] = float(stop_requested)
    dist.all_reduce(totals)
    values = totals.tolist()
    return (values[0] if width == 1 else values[:width]), values[width] > 0


def _forward_step_func(model_call, ctx: StepContext, device):
    """`model_call(chunk)`: what runs the forward of the model chunk the schedule hands over."""
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        args, kwargs = ctx.inputs(batch, device, ctx)
        logits = model_call(model)(*args, **kwargs)

        def loss_func(output):
            if ctx.objective is not None:
                return ctx.objective(output, batch, ctx)
            losses = loss_lib.token_losses(output, batch["labels"].to(device), ctx.vocab_mask)
            scaled, total = loss_lib.scaled_loss(losses, batch["loss_mask"].to(device), ctx.num_microbatches, ctx.dp, ctx.global_tokens)
            return scaled, {"loss_sum": total}

        return logits, loss_func

    return forward_step


def schedule_outputs(model_call, module, batches: list[dict], ctx: StepContext, forward_only: bool) -> list[dict]:
    """megatron-core's pipeline schedule over the micro-batches: the loss function's dicts, one per
    micro-batch, on the last stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(module.parameters()).device
    if isinstance(module, VirtualStages):  # interleaved: every chunk reads the micro-batches in order
        model, data = list(module), [iter(batches) for _ in module]
        call = lambda chunk: functools.partial(model_call, stage=module.index(chunk))  # noqa: E731
    else:
        model, data, call = module, iter(batches), lambda chunk: model_call
    return get_forward_backward_func()(
        forward_step_func=_forward_step_func(call, ctx, device),
        data_iterator=data,
        model=model,
        num_microbatches=len(batches),
        seq_length=ctx.seq_len,
        micro_batch_size=ctx.micro_batch,
        forward_only=forward_only,
    )


def run_schedule(model_call, module, batches: list[dict], ctx: StepContext, forward_only: bool,
                 stop_requested: Callable[[], bool] = lambda: False) -> tuple[float, bool]:
    """Run the micro-batches; returns (the global-batch mean loss, whether any rank was asked to
    stop: `stop_requested()` is read after the last backward), the same on every rank."""
    device = next(module.parameters()).device
    outputs = schedule_outputs(model_call, module, batches, ctx, forward_only)
    # Tensors summed without a host sync per micro-batch; outputs is empty off the last stage.
    width = getattr(ctx.objective, "width", 0)  # an objective with metrics of its own (the loss sum first)
    if width:  # every rank reduces the same width; only the last stage has outputs
        sums = torch.stack([o["sums"].double() for o in outputs]).sum(dim=0) if outputs else None
        ctx.sums, stop = reduce_step_totals(sums, stop_requested(), device, width=width)
        return ctx.sums[0] / max(ctx.global_tokens, 1), stop
    loss_sum = torch.stack([o["loss_sum"].double() for o in outputs]).sum() if outputs else None
    loss_total, stop = reduce_step_totals(loss_sum, stop_requested(), device)
    return loss_total / max(ctx.global_tokens, 1), stop


def train_step(engine, module, batches, ctx: StepContext, tied: bool,
               stop_requested: Callable[[], bool] = lambda: False) -> tuple[float, float | None, bool]:
    """Forward/backward every micro-batch, finish the gradients DeepSpeed doesn't know about, step.

    Returns (loss, gradient norm before clipping, whether any rank was asked to stop: the
    preemption flag rides on the loss's all-reduce)."""
    from toolkit.train.parallel import allreduce_tied_embedding_grads

    # engine(...) registers DeepSpeed's backward hooks; the schedule calls backward itself.
    loss, stop = run_schedule(engine, module, batches, ctx, forward_only=False, stop_requested=stop_requested)
    allreduce_tied_embedding_grads(module, tied)
    engine.step()
    norm = engine.get_global_grad_norm()
    return loss, None if norm is None else float(norm), stop


def eval_loss(module, batches, ctx: StepContext) -> float:
    module.eval()
    with torch.no_grad():
        loss, _ = run_schedule(module, module, batches, ctx, forward_only=True)
    module.train()
    return loss


def evaluate(module, source, make_context, reference=None) -> float | tuple[float, list[float]]:
    """Token-weighted mean loss over every full global batch of the validation set (at least one).
    With `reference` (method=dpo): each batch's reference log-probs first, and the result is
    (mean loss over pairs, the objective's sums as means over those pairs)."""
    source.consumed = 0
    total = tokens = 0.0
    sums = None
    for _ in range(max(1, len(source.rows) // source.global_batch)):
        batches = source.next_global_batch()
        ctx = make_context(batches, source.last_counts)
        if reference is not None:
            reference.attach(batches, ctx)
        total += eval_loss(module, batches, ctx) * ctx.global_tokens
        tokens += ctx.global_tokens
        if ctx.sums is not None:
            sums = ctx.sums if sums is None else [a + b for a, b in zip(sums, ctx.sums)]
    mean = total / max(tokens, 1.0)
    return mean if reference is None else (mean, [v / max(tokens, 1.0) for v in sums])
