"""The bubble benchmark's split of idle time (benchmarks/bubble_replay.py) on hand-made 1F1B traces."""

from __future__ import annotations

import pytest

from benchmarks.bubble_replay import Op, split_step, theory

FORWARD, BACKWARD = 1.0, 2.0


def one_f_one_b(pp: int, m: int, slow_stage: int | None = None, slowdown: float = 1.0) -> list[list[Op]]:
    """Each rank's 1F1B order (warm-up forwards, then one forward one backward, then the rest),
    with start times from a replay-independent clock: only the order and durations matter."""
    ranks = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(m - warmup, m)]
        scale = slowdown if rank == slow_stage else 1.0
        ops, clock = [], 0.0
        for kind, micro in order:
            seconds = (FORWARD if kind == "F" else BACKWARD) * scale
            ops.append(Op(kind, rank, micro, clock, clock + seconds))
            clock += seconds
        ranks.append(ops)
    return ranks


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 8)])
def test_balanced_1f1b_has_the_theoretical_bubble_and_nothing_else(pp, m):
    ideal = (m + pp - 1) * (FORWARD + BACKWARD)
    split = split_step(one_f_one_b(pp, m), (0.0, ideal), pp)
    assert split.bubble_share_balanced == pytest.approx(theory(pp, m))
    assert split.imbalance == pytest.approx(0.0) and split.p2p == pytest.approx(0.0)
    assert split.compute + split.bubble == pytest.approx(ideal)


def test_a_slow_stage_is_imbalance_and_a_longer_window_is_p2p():
    split = split_step(one_f_one_b(2, 4, slow_stage=1, slowdown=2.0), (0.0, 40.0), 2)
    assert split.imbalance > 1.0
    assert split.p2p == pytest.approx(40.0 - (split.compute + split.bubble + split.imbalance))
    assert split.bubble_share_balanced == pytest.approx(theory(2, 4))
