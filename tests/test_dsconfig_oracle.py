"""Generated configs are accepted by DeepSpeed's own parser at their DP size, and rejected at any
other DP size (which proves the oracle is live: see tests/ds_oracle.py for the two traps)."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ds_oracle import oracle  # noqa: F401 - fixture
from toolkit.dsconfig import Monitoring, SchedulerSettings, Setup, build, check
from toolkit.errors import ConfigError
from toolkit.modelspec import read

MODELS = Path(__file__).resolve().parents[1] / "ds_configs" / "models"
SPECS = {name: read(MODELS / name) for name in ("llama-3-8b", "llama-3-70b")}

OFFLOADS = {  # (optimizer, parameters) offload, per ZeRO stage that allows it
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none")],
    2: [("none", "none"), ("cpu", "none")],
    3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")],
}


def grid():
    layouts = [(g, tp, pp) for g in (8, 64, 512) for tp in (1, 2, 8) for pp in (1, 2, 4) if g % (tp * pp) == 0]
    for (gpus, tp, pp), zero, precision, schedule in itertools.product(
            layouts, range(4), ("bf16", "fp16", "fp32"), ("deepspeed", "megatron")):
        if pp > 1 and zero >= 2:
            continue
        for (opt, par), steps in itertools.product(OFFLOADS[zero], (1, 4)):
            dp = gpus // (tp * pp)
            yield Setup(gpus=gpus, tp=tp, pp=pp, zero=zero, precision=precision, schedule=schedule, micro_batch=2,
                        global_batch=2 * dp * steps, offload_optimizer=opt, offload_param=par, nvme_path="/local_nvme")


def instantiate_scheduler(config: dict) -> None:
    """DeepSpeedConfig does not build the LR scheduler; deepspeed.initialize does, with these params."""
    import torch
    from deepspeed.runtime import lr_schedules

    if "scheduler" in config:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config["optimizer"]["params"]["lr"])
        getattr(lr_schedules, config["scheduler"]["type"])(optimizer, **config["scheduler"]["params"]).step()


def assert_deepspeed_agrees(oracle, config: dict, setup: Setup) -> None:
    error = oracle.error(config, setup.dp)
    assert error is None, (setup, error)
    instantiate_scheduler(config)
    for wrong in {setup.dp * 2, max(1, setup.dp // 2)} - {setup.dp}:
        assert "Check batch related parameters" in (oracle.error(config, wrong) or ""), (setup, wrong)
    report = check(config, gpus=setup.gpus, tp=setup.tp, pp=setup.pp)
    assert report.problems == [], (setup, report.lines())


def test_grid_of_layouts_is_accepted_by_deepspeed_at_its_dp_and_only_there(oracle):
    setups = list(grid())
    assert len(setups) > 1000
    for setup in setups:
        assert_deepspeed_agrees(oracle, build(setup, SPECS["llama-3-70b"]), setup)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    model=st.sampled_from(sorted(SPECS)),
    gpus=st.sampled_from([1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024]),
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4, 8]), zero=st.integers(0, 3),
    precision=st.sampled_from(["bf16", "fp16", "fp32"]), schedule=st.sampled_from(["deepspeed", "megatron"]),
    micro=st.integers(1, 8), steps=st.integers(1, 64), offload=st.sampled_from(["none", "cpu", "nvme"]),
    offload_param=st.sampled_from(["none", "cpu"]), monitors=st.booleans(),
    scheduler=st.sampled_from([None, SchedulerSettings("WarmupCosineLR", 10, 100, 0.1),
                               SchedulerSettings("WarmupDecayLR", 0, 100), SchedulerSettings("WarmupLR", 5, 100)]),
)
def test_any_setup_is_either_refused_or_accepted_by_deepspeed(oracle, model, gpus, tp, pp, zero, precision, schedule,
                                                              micro, steps, offload, offload_param, monitors, scheduler):
    monitoring = Monitoring(tensorboard_dir="tb", csv_dir="csv") if monitors else Monitoring()
    try:
        setup = Setup(gpus=gpus, tp=tp, pp=pp, zero=zero, precision=precision, schedule=schedule, micro_batch=micro,
                      global_batch=micro * max(1, gpus // (tp * pp)) * steps, offload_optimizer=offload,
                      offload_param=offload_param, nvme_path="/nvme", monitoring=monitoring, scheduler=scheduler)
        config = build(setup, SPECS[model])
    except ConfigError:
        return
    assert_deepspeed_agrees(oracle, config, setup)


def test_without_a_process_group_deepspeed_ignores_the_mpu(tmp_path):
    """The trap the oracle avoids: in a fresh process DeepSpeedConfig checks every batch against
    world size 1, so a DP=8 config is rejected and a wrong one accepted."""
    import subprocess
    import sys

    script = (
        "import json, os, sys; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
        "from deepspeed.runtime.config import DeepSpeedConfig\n"
        "from tests.ds_oracle import StandInMPU\n"
        "config = json.loads(sys.argv[1])\n"
        "DeepSpeedConfig(config, mpu=StandInMPU(8))\n"
        "print('accepted with world size', DeepSpeedConfig(config, mpu=StandInMPU(8)).world_size)\n"
    )
    config = '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}'
    out = subprocess.run([sys.executable, "-c", script, config], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    # 16 = 2 x 8 x 1 is right for DP 1, wrong for the DP 8 the stand-in reports: accepted anyway.
    assert "accepted with world size 1" in out.stdout, out.stderr[-2000:]
