"""The DPO losses and metrics of TRL 1.16's DPOTrainer, on megatron-core's vocab-parallel logits.

A micro-batch holds m pairs as 2m rows, chosen then rejected (toolkit.train.preference). Each
row's log-probability is the sum of its completion tokens' log-probabilities (TRL without ld_alpha).
The reference's come from a forward-only pass just before (`ReferencePass`), kept on the batch.

The loss is the mean over the global batch's pairs: each micro-batch returns
sum(pair losses) * num_microbatches * dp / global_pairs, which megatron-core's schedule divides by
num_microbatches and DeepSpeed averages over DP, as the SFT loss (toolkit.train.loss). TRL's
metrics are means over the global batch's pairs: each micro-batch returns its sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.train import loss as loss_lib

# TRL's metric names, in the order of the sums each micro-batch returns
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def sequence_logps(logits: torch.Tensor, batch: dict, vocab_mask) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens, [2m]."""
    device = logits.device
    losses = loss_lib.token_losses(logits, batch["labels"].to(device), vocab_mask)
    return -(losses * batch["loss_mask"].to(device)).sum(dim=1)


def pair_losses(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor, loss_type: str, beta: float,
                label_smoothing: float) -> torch.Tensor:
    """Per-pair loss from [2m] policy and reference log-probabilities (chosen first) and [2m]
    completion lengths, as TRL's `_compute_loss` (f_divergence reverse_kl, no weighting)."""
    chosen, rejected = (logps - ref_logps).chunk(2)
    delta = chosen - rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "ipo":  # TRL normalises each log-ratio by its completion's length (confirmed with IPO's authors)
        chosen_len, rejected_len = lengths.clamp(min=1.0).chunk(2)
        return (chosen / chosen_len - rejected / rejected_len - 1 / (2 * beta)) ** 2
    if loss_type == "robust":  # rDPO: label_smoothing is the chance that a label is flipped
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    raise ValueError(f"unknown dpo.loss_type {loss_type!r}")


def metric_sums(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Sums over this micro-batch's pairs of each of METRICS."""
    chosen_rewards, rejected_rewards = (beta * (logps - ref_logps)).detach().chunk(2)
    chosen_logps, rejected_logps = logps.detach().chunk(2)
    return torch.stack([chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                        (chosen_rewards - rejected_rewards).sum(), chosen_logps.sum(), rejected_logps.sum()])


@dataclass(frozen=True)
class DpoObjective:
    """The training loss of a DPO step (StepContext.objective): reads the reference log-probs the
    reference pass left on the batch."""

    loss_type: str
    beta: float
    label_smoothing: float

    width = 1 + len(METRICS)  # the loss sum, then METRICS' sums (toolkit.train.step.run_schedule)

    @classmethod
    def from_config(cls, cfg) -> "DpoObjective":
        return cls(cfg.dpo.loss_type, cfg.dpo.beta, cfg.dpo.label_smoothing)

    def __call__(self, output, batch, ctx):
        logps = sequence_logps(output, batch, ctx.vocab_mask)
        ref = batch["ref_logps"].to(logps.device)
        lengths = batch["loss_mask"].to(logps.device).sum(dim=1)
        losses = pair_losses(logps, ref, lengths, self.loss_type, self.beta, self.label_smoothing)
        total = losses.sum()
        sums = torch.cat([total.detach()[None], metric_sums(logps, ref, self.beta)])
        return total * (ctx.num_microbatches * ctx.dp / ctx.global_tokens), {"loss_sum": total.detach(), "sums": sums}


def reference_logps(output, batch, ctx):
    """The reference pass's loss function: keeps each row's log-probability on the batch (the last
    stage reads it in the training pass) and returns nothing to backpropagate."""
    logps = sequence_logps(output, batch, ctx.vocab_mask).detach()
    batch["ref_logps"] = logps
    return logps.sum() * 0.0, {}


def named_metrics(sums: list[float], pairs: float, prefix: str = "") -> dict[str, float]:
    """TRL's metric names for the objective's sums (the loss sum first, left out), each the mean
    over `pairs` pairs."""
    return {prefix + name: value / pairs for name, value in zip(METRICS, sums[1:])}
