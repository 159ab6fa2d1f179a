"""The device-strict collective check: CPU runs catch tensors that NCCL would refuse.

gloo accepts host tensors, so on this machine a collective on a tensor created without
`device=` passes and would raise on the first step under NCCL. The multi-process fine-tuning
tests run with TOOLKIT_STRICT_DEVICES=1 (tests/finetune_harness.py); this test shows that the
check refuses what NCCL would and accepts what it would, on real gloo processes."""

from __future__ import annotations

import pytest

from toolkit.runtime.launch import run_on_processes


@pytest.mark.multiprocess
def test_host_tensors_in_collectives_are_refused_and_the_step_reduction_passes(monkeypatch):
    monkeypatch.setenv("TOOLKIT_STRICT_DEVICES", "1")
    verdicts = run_on_processes("tests.mp_workers:strict_device_checks", 2, 2)
    for rank_verdicts in verdicts:
        assert rank_verdicts["host tensor"] and rank_verdicts["host tensor after arithmetic"]
        assert not rank_verdicts["made on the device"] and not rank_verdicts["moved to the device"]
        assert rank_verdicts["step totals"] == (5.0, True), "loss sums 2.5 + 2.5; rank 1's stop reaches both"
