"""One optimizer step (and one evaluation pass) through megatron-core's pipeline schedule."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.train import loss as loss_lib
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


def count_global_tokens(batches: list[dict], device) -> tuple[int, int]:
    """(loss tokens, non-padding tokens) of the whole global batch: this rank's micro-batches,
    summed over DP in one all-reduce, on the compute device (NCCL refuses host tensors)."""
    from megatron.core import parallel_state as ps

    local = torch.tensor([sum(float(b["loss_mask"].sum()) for b in batches), sum(int(b["real_tokens"]) for b in batches)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(local, group=ps.get_data_parallel_group())
    loss_tokens, real_tokens = local.tolist()
    return int(loss_tokens), int(real_tokens)


def _forward_step_func(model_call, ctx: StepContext, device):
    """`model_call(chunk)`: what runs the forward of the model chunk the schedule hands over."""
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(device)
        positions = torch.arange(tokens.shape[1], device=device)[None].expand(tokens.shape[0], -1)
        mask = batch.get("attention_mask")
        extra = {"padding_mask": routing_padding_mask(batch["padding"].to(device), ctx)} if ctx.moe else {}
        logits = model_call(model)(tokens, positions, None if mask is None else mask.to(device), **extra)

        def loss_func(output):
            losses = loss_lib.token_losses(output, batch["labels"].to(device), ctx.vocab_mask)
            scaled, total = loss_lib.scaled_loss(losses, batch["loss_mask"].to(device), ctx.num_microbatches, ctx.dp, ctx.global_tokens)
            return scaled, {"loss_sum": total}

        return logits, loss_func

    return forward_step


def routing_padding_mask(padding: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """[b, s], True at padding: megatron-core then leaves those tokens out of the load-balancing
    loss (router.py:598-611), as HF does with an attention mask. Under sequence parallelism GPTModel
    scatters it over TP on the first stage only (gpt_model.py:314); later stages get their slice here."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    if ctx.sequence_parallel and not ps.is_pipeline_first_stage():
        return scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
    return padding


def run_schedule(model_call, module, batches: list[dict], ctx: StepContext, forward_only: bool) -> float:
    """Run the micro-batches; returns the global-batch mean loss (valid on every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(module.parameters()).device
    if isinstance(module, VirtualStages):  # interleaved: every chunk reads the micro-batches in order
        model, data = list(module), [iter(batches) for _ in module]
        call = lambda chunk: functools.partial(model_call, stage=module.index(chunk))  # noqa: E731
    else:
        model, data, call = module, iter(batches), lambda chunk: model_call
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step_func(call, ctx, device),
        data_iterator=data,
        model=model,
        num_microbatches=len(batches),
        seq_length=ctx.seq_len,
        micro_batch_size=ctx.micro_batch,
        forward_only=forward_only,
    )
    total = torch.zeros((), dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage():
        total += sum(float(o["loss_sum"]) for o in outputs)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())  # only the last stage is non-zero
    return float(total) / max(ctx.global_tokens, 1)


def train_step(engine, module, batches, ctx: StepContext, tied: bool) -> tuple[float, float | None]:
    """Forward/backward every micro-batch, finish the gradients DeepSpeed doesn't know about, step.

    Returns (loss, gradient norm before clipping)."""
    from toolkit.train.parallel import allreduce_tied_embedding_grads

    # engine(...) registers DeepSpeed's backward hooks; the schedule calls backward itself.
    loss = run_schedule(engine, module, batches, ctx, forward_only=False)
    allreduce_tied_embedding_grads(module, tied)
    engine.step()
    norm = engine.get_global_grad_norm()
    return loss, None if norm is None else float(norm)


def eval_loss(module, batches, ctx: StepContext) -> float:
    module.eval()
    with torch.no_grad():
        loss = run_schedule(module, module, batches, ctx, forward_only=True)
    module.train()
    return loss


def evaluate(module, source, make_context) -> float:
    """Token-weighted mean loss over every full global batch of the validation set (at least one)."""
    source.consumed = 0
    total = tokens = 0.0
    for _ in range(max(1, len(source.rows) // source.global_batch)):
        batches = source.next_global_batch()
        ctx = make_context(batches)
        total += eval_loss(module, batches, ctx) * ctx.global_tokens
        tokens += ctx.global_tokens
    return total / max(tokens, 1.0)
