"""Split a pipeline step's idle time into bubble, imbalance and p2p from per-micro-batch timestamps
(benchmarks/bubble_timed_recipe.py records them; benchmarks/bubble_bench.py reports them).

For one step, every rank's forwards and backwards are replayed in the order that rank ran them,
each starting when its rank is free and its inputs exist (forward of stage s, micro-batch i after
forward (s-1, i); backward (s, i) after backward (s+1, i), or after forward (s, i) on the last
stage), with no time for transfers:

    T        the measured step (schedule start to end, over all ranks)
    C        compute per rank (the sum of its forwards and backwards), averaged over ranks
    T_sim    the replay with the measured durations
    T_bal    the replay with every forward (backward) taking the mean forward (backward) time

    idle = T - C = bubble + imbalance + p2p, with
    bubble    = T_bal - C      the schedule's own idle time on perfectly balanced stages
    imbalance = T_sim - T_bal  what unequal stages (and micro-batches) add
    p2p       = T - T_sim      what the transfers (and the schedule's own overhead) add

The bubble's share of T_bal is the one theory predicts: (p - 1) / (m + p - 1) for 1F1B, and
(p - 1) / (V m + p - 1) with V virtual stages (interleaved 1F1B: the bubble divided by V)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    stage: int  # in the PP x VPP pipeline
    micro: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def theory(pp: int, microbatches: int, vpp: int = 1) -> float:
    """The bubble's share of a step on balanced stages with free transfers."""
    return (pp - 1) / (vpp * microbatches + pp - 1)


def replay(ranks: list[list[Op]], seconds, stages: int) -> float:
    """Makespan of the ranks' ops, each rank in its own order, each op after its inputs."""
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(ranks)
    position = [0] * len(ranks)
    remaining = sum(len(ops) for ops in ranks)
    while remaining:
        progressed = False
        for r, ops in enumerate(ranks):
            while position[r] < len(ops):
                op = ops[position[r]]
                needs = _input_of(op, stages)
                if needs is not None and needs not in done:
                    break
                start = max(free[r], done[needs] if needs is not None else 0.0)
                free[r] = done[(op.kind, op.stage, op.micro)] = start + seconds(op)
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded order cannot be replayed: an op waits for one that never runs first")
    return max(free)


def _input_of(op: Op, stages: int) -> tuple[str, int, int] | None:
    if op.kind == "F":
        return None if op.stage == 0 else ("F", op.stage - 1, op.micro)
    return ("F", op.stage, op.micro) if op.stage == stages - 1 else ("B", op.stage + 1, op.micro)


@dataclass
class StepSplit:
    step: float  # seconds
    compute: float
    bubble: float
    imbalance: float
    p2p: float
    idle_per_rank: list[float]  # measured, T - C_r
    bubble_share_balanced: float  # (T_bal - C) / T_bal, against theory()


def split_step(ranks: list[list[Op]], window: tuple[float, float], stages: int) -> StepSplit:
    """`ranks`: each rank's ops of one step in the order it ran them; `window`: the step's start and end."""
    ranks = [sorted(ops, key=lambda op: op.start) for ops in ranks]
    step = window[1] - window[0]
    per_rank = [sum(op.seconds for op in ops) for ops in ranks]
    compute = sum(per_rank) / len(ranks)
    by_kind = defaultdict(list)
    for op in (op for ops in ranks for op in ops):
        by_kind[op.kind].append(op.seconds)
    mean = {kind: sum(times) / len(times) for kind, times in by_kind.items()}
    simulated = replay(ranks, lambda op: op.seconds, stages)
    balanced = replay(ranks, lambda op: mean[op.kind], stages)
    return StepSplit(step, compute, balanced - compute, simulated - balanced, step - simulated,
                     [step - c for c in per_rank], (balanced - compute) / balanced)
