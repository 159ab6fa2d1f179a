"""Per-step losses and gradient norms of the megatron-core run and the HF reference, side by side,
and what the first difference says: the conversion (the forward differs before any update) or the
training setup (the model matched, the updates did not)."""

from __future__ import annotations

from dataclasses import dataclass

# What the first divergence points at, by where it shows first.
FORWARD = ("the forward pass differs before any weight update: the conversion (a weight, or a config value such as "
           "the RoPE base, rope scaling, norm epsilon or tied embeddings) or how the data is tokenised; "
           "`toolkit convert verify` compares the checkpoint's logits with HF's")
BACKWARD = ("the same loss but other gradients at step 1: the backward or the gradient reduction of this setup "
            "(layout, loss normalisation over micro-batches and DP ranks), or a weight shared differently "
            "(tied embeddings) by the conversion")
UPDATE = ("step 1 matched, so the converted model computes what HF computes; the updates differ: the training "
          "setup (learning rate and warmup, weight decay, Adam betas/eps, gradient clipping, data order)")


@dataclass(frozen=True)
class StepPair:
    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.ref_loss)

    @property
    def norm_diff(self) -> float:
        """Relative to the reference, or absolute below 1 (a norm near 0 has no useful ratio)."""
        return abs(self.grad_norm - self.ref_grad_norm) / max(1.0, self.ref_grad_norm)


@dataclass(frozen=True)
class Verdict:
    pairs: tuple[StepPair, ...]
    loss_tolerance: float
    norm_tolerance: float

    @property
    def first_divergence(self) -> tuple[int, str] | None:
        """(step, "loss" or "grad norm") of the first number out of tolerance; the loss first, as
        the step's gradient comes from its forward."""
        for p in self.pairs:
            if not p.loss_diff <= self.loss_tolerance:  # NaN diverges too
                return p.step, "loss"
            if not p.norm_diff <= self.norm_tolerance:
                return p.step, "grad norm"
        return None

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def suggestion(self) -> str:
        first = self.first_divergence
        if first is None:
            return "megatron-core trains like HF on this model and data"
        if first[0] == 1:
            return FORWARD if first[1] == "loss" else BACKWARD
        return UPDATE

    def table(self) -> list[str]:
        lines = [f"{'step':>4}  {'loss megatron':>14}  {'loss HF':>14}  {'|diff|':>8}  "
                 f"{'grad norm megatron':>18}  {'grad norm HF':>14}  {'rel diff':>8}"]
        for p in self.pairs:
            lines.append(f"{p.step:>4}  {p.loss:>14.7f}  {p.ref_loss:>14.7f}  {p.loss_diff:>8.1e}  "
                         f"{p.grad_norm:>18.7f}  {p.ref_grad_norm:>14.7f}  {p.norm_diff:>8.1e}")
        return lines

    def summary(self) -> str:
        bars = f"loss within {self.loss_tolerance:g}, grad norm within {self.norm_tolerance:g} relative"
        first = self.first_divergence
        if first is None:
            return f"PASS ({bars}, {len(self.pairs)} steps): {self.suggestion()}"
        step, quantity = first
        pair = self.pairs[step - 1]
        diff = pair.loss_diff if quantity == "loss" else pair.norm_diff
        return f"FAIL ({bars}): the {quantity} diverges first at step {step} ({diff:.1e}): {self.suggestion()}"


def judge(metrics: list[dict], ref_losses: list[float], ref_norms: list[float], loss_tolerance: float,
          norm_tolerance: float) -> Verdict:
    """`metrics`: the run's metrics.jsonl records, steps 1..N, as many as the reference's steps."""
    steps = [m["step"] for m in metrics]
    if steps != list(range(1, len(ref_losses) + 1)):
        raise ValueError(f"the run logged steps {steps}, the reference has {len(ref_losses)}")
    pairs = tuple(StepPair(m["step"], m["loss"], r, m["grad_norm"], n) for m, r, n in zip(metrics, ref_losses, ref_norms))
    return Verdict(pairs, loss_tolerance, norm_tolerance)
