"""The training loss: mean cross-entropy over every unmasked token of the global batch.

Each micro-batch returns sum(token losses) * num_microbatches * dp / global_tokens. megatron-core's
schedule divides it by num_microbatches and DeepSpeed averages gradients over DP, so the gradient
is that of sum(all token losses) / global_tokens: not a mean of per-micro-batch means, which
would weight a short micro-batch's tokens more (the gradient-accumulation bug).

Padded vocab rows are masked to -inf before the vocab-parallel cross-entropy, so the loss is that
of the true vocab (megatron-core does not mask them).
"""

from __future__ import annotations

import torch


def padded_vocab_mask(vocab_size: int, padded_vocab_size: int, tp: int, tp_rank: int, device) -> torch.Tensor | None:
    """Bool mask over this TP rank's logit columns that lie beyond the true vocab (None if none)."""
    per_rank = padded_vocab_size // tp
    columns = torch.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, device=device)
    mask = columns >= vocab_size
    return mask if bool(mask.any()) else None


def token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_mask: torch.Tensor | None) -> torch.Tensor:
    """Per-token cross-entropy from vocab-parallel logits [b, s, V/tp]."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if vocab_mask is not None:
        logits = logits.masked_fill(vocab_mask, float("-inf"))
    if ps.get_tensor_model_parallel_world_size() == 1:
        # The whole vocabulary is here: torch's fused kernel, as HF computes it, without the
        # vocab-parallel version's three all-reduces over a group of one and its unfused passes.
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    return vocab_parallel_cross_entropy(logits, labels)


def scaled_loss(losses: torch.Tensor, loss_mask: torch.Tensor, num_microbatches: int, dp: int, global_tokens: int):
    """(loss to backpropagate, sum of this micro-batch's token losses)."""
    total = (losses * loss_mask).sum()
    return total * (num_microbatches * dp / global_tokens), total.detach()
