"""The DeepSpeed config builder: consistent batch values, pinned defaults, and clear refusals."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from toolkit.dsconfig import Monitoring, OptimizerSettings, SchedulerSettings, Setup, build
from toolkit.errors import ConfigError
from toolkit.modelspec import read

MODELS = Path(__file__).resolve().parents[1] / "ds_configs" / "models"


@pytest.fixture(scope="module")
def llama8b():
    return read(MODELS / "llama-3-8b")


def test_standard_mode_batch_values_are_consistent_for_the_data_parallel_size(llama8b):
    config = build(Setup(gpus=64, tp=8, pp=2, zero=1, micro_batch=2, global_batch=512), llama8b)
    # 64 GPUs / (TP 8 x PP 2) = DP 4: 512 = 2 x 64 x 4
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (512, 2, 64)
    assert config["managed_gradient_accumulation"] is True


def test_megatron_schedule_mode_hands_deepspeed_one_step_per_global_batch(llama8b):
    config = build(Setup(gpus=64, tp=8, pp=2, zero=1, micro_batch=2, global_batch=512, schedule="megatron"), llama8b)
    # megatron-core runs 64 micro-batches of 2; DeepSpeed must not divide the gradients again.
    assert config["gradient_accumulation_steps"] == 1
    assert config["train_micro_batch_size_per_gpu"] == 2 * 64
    assert config["train_batch_size"] == 512
    assert config["managed_gradient_accumulation"] is False
    assert config["zero_optimization"]["overlap_comm"] is False  # DeepSpeed asserts otherwise below ZeRO-2
    z2 = build(Setup(gpus=8, zero=2, micro_batch=1, global_batch=16, schedule="megatron"), llama8b)
    assert z2["zero_optimization"]["overlap_comm"] is True


def test_fp16_gets_dynamic_loss_scaling_and_bf16_none(llama8b):
    fp16 = build(Setup(gpus=8, zero=2, precision="fp16"), llama8b)["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                    "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
    bf16_config = build(Setup(gpus=8, zero=2, precision="bf16"), llama8b)
    assert "fp16" not in bf16_config
    assert set(bf16_config["bf16"]) == {"enabled", "check_grad_overflow"}
    assert "bf16" not in build(Setup(gpus=8, zero=2, precision="fp32"), llama8b)


def test_defaults_that_moved_between_releases_are_pinned(llama8b):
    config = build(Setup(gpus=8, zero=1, scheduler=SchedulerSettings(warmup_steps=10)), llama8b)
    assert config["gradient_clipping"] == 1.0  # 0.0 before ~0.19.3
    assert config["zero_optimization"]["overlap_comm"] is False  # stage-dependent default
    assert config["bf16"]["check_grad_overflow"] is True  # changed in PR #8035
    assert config["scheduler"]["params"]["warmup_type"] == "linear"  # DeepSpeed's default is log


def test_bucket_sizes_come_from_the_hidden_size_as_integers(llama8b):
    zero3 = build(Setup(gpus=8, zero=3), llama8b)["zero_optimization"]
    h = llama8b.hidden_size
    assert zero3["reduce_bucket_size"] == h * h
    assert zero3["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert zero3["stage3_param_persistence_threshold"] == 10 * h
    for value in zero3.values():
        assert not isinstance(value, float), zero3


@pytest.mark.parametrize(
    "setup, message",
    [
        (Setup(gpus=64, tp=8, micro_batch=4, global_batch=100), "not divisible by micro-batch x DP = 4 x 8"),
        (Setup(gpus=64, tp=3, pp=2), "64 % 6 = 4"),
        (Setup(gpus=64, tp=8, pp=2, zero=2), "ZeRO-2 cannot be combined with pipeline parallelism"),
        (Setup(gpus=64, tp=8, pp=2, zero=3), "ZeRO-3 cannot be combined with pipeline parallelism"),
        (Setup(gpus=8, zero=0, offload_optimizer="cpu"), "offload needs ZeRO"),
        (Setup(gpus=8, zero=2, offload_param="cpu"), "parameter offload needs ZeRO-3"),
        (Setup(gpus=8, zero=2, offload_optimizer="nvme", nvme_path="/nvme"), "silently treats it as CPU offload"),
        (Setup(gpus=8, zero=3, offload_param="nvme"), "needs an nvme_path"),
        (Setup(gpus=8, precision="bf16+fp16"), "unknown precision"),
        (Setup(gpus=8, zero=4), "ZeRO stage must be 0, 1, 2 or 3"),
        (Setup(gpus=64, tp=64), "32 attention heads are not divisible by --tp 64"),
        (Setup(gpus=6, pp=3), "32 layers cannot be split evenly over --pp 3"),
        (Setup(gpus=8, schedule="megatron", monitoring=Monitoring(wandb_project="p")), "logs to W&B itself"),
        (Setup(gpus=8, schedule="megatron", activation_checkpointing=True), "recompute_granularity"),
        (Setup(gpus=8, tp=2, hf_trainer=True), "data parallelism only"),
        (Setup(gpus=8, scheduler=SchedulerSettings(warmup_steps=50, total_steps=10)), "warmup steps"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_refuses_with_a_message_that_says_what_to_change(llama8b, setup, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        build(setup, llama8b)


def test_bf16_and_fp16_together_is_refused_by_the_cli_flags():
    from toolkit.commands.ds_config import precision_from_flags

    with pytest.raises(ConfigError, match="fp16 and bf16 cannot both be enabled"):
        precision_from_flags(["bf16", "fp16"])
    assert precision_from_flags(["fp16"]) == "fp16"
    assert precision_from_flags([]) == "bf16"


def test_offload_nvme_and_monitoring_blocks(llama8b):
    config = build(Setup(gpus=8, zero=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/local_nvme",
                         monitoring=Monitoring(tensorboard_dir="tb", csv_dir="csv", wandb_project="proj")), llama8b)
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}
    assert zero["offload_param"]["device"] == "nvme"
    assert config["aio"]["block_size"] == 1_048_576
    assert config["tensorboard"] == {"enabled": True, "output_path": "tb", "job_name": "toolkit"}
    assert config["csv_monitor"]["output_path"] == "csv"
    assert config["wandb"] == {"enabled": True, "project": "proj"}


def test_activation_checkpointing_and_optimizer_settings(llama8b):
    config = build(Setup(gpus=8, activation_checkpointing=True,
                         optimizer=OptimizerSettings(lr=3e-4, weight_decay=0.1, torch_adam=True),
                         scheduler=SchedulerSettings("WarmupDecayLR", warmup_steps=10, total_steps=100)), llama8b)
    assert config["activation_checkpointing"]["partition_activations"] is False
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                               "weight_decay": 0.1, "torch_adam": True}}
    assert config["scheduler"]["params"]["total_num_steps"] == 100
    assert config["scheduler"]["params"]["warmup_max_lr"] == 3e-4


def test_global_batch_defaults_to_one_micro_batch_per_rank(llama8b):
    config = build(Setup(gpus=512, tp=8, pp=4, micro_batch=3), llama8b)
    assert config["train_batch_size"] == 3 * 16
    assert config["gradient_accumulation_steps"] == 1


def test_generating_a_config_stays_interactive(llama8b):
    """A regression guard only, with a margin a busy 2-core machine cannot hit (it takes well under 1 ms;
    benchmarks/dsconfig_bench.py measures it)."""
    setup = Setup(gpus=512, tp=8, pp=4, zero=1, micro_batch=1, global_batch=1024, schedule="megatron")
    start = time.perf_counter()
    for _ in range(100):
        build(setup, llama8b)
    assert (time.perf_counter() - start) / 100 < 0.2


def test_without_total_steps_no_schedule_decays_the_lr_at_an_invented_step(llama8b):
    """No step count given: no WarmupCosineLR/WarmupDecayLR with a made-up total_num_steps."""
    assert "scheduler" not in build(Setup(gpus=8), llama8b)
    warm = build(Setup(gpus=8, scheduler=SchedulerSettings("WarmupLR", warmup_steps=100)), llama8b)["scheduler"]
    assert warm["type"] == "WarmupLR" and "total_num_steps" not in warm["params"]
    with pytest.raises(ConfigError, match="needs the total number of steps"):
        build(Setup(gpus=8, scheduler=SchedulerSettings("WarmupCosineLR", warmup_steps=10)), llama8b)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("setup, message", [
    (Setup(gpus=8, optimizer=OptimizerSettings(lr=NAN)), "lr must be a finite number >= 0 (got nan)"),
    (Setup(gpus=8, optimizer=OptimizerSettings(lr=-1e-5)), "lr must be a finite number >= 0 (got -1e-05)"),
    (Setup(gpus=8, optimizer=OptimizerSettings(betas=(0.9,))), "betas must be 2 numbers"),
    (Setup(gpus=8, optimizer=OptimizerSettings(betas=(0.9, 1.0))), "betas must be 2 numbers >= 0 and < 1"),
    (Setup(gpus=8, gradient_clipping=-1.0), "gradient_clipping must be a finite number >= 0"),
    (Setup(gpus=8, micro_batch=INF), "micro_batch must be an integer >= 1 (got inf)"),
    (Setup(gpus=8, micro_batch=NAN), "micro_batch must be an integer >= 1 (got nan)"),
    (Setup(gpus=8, micro_batch=2.0), "micro_batch must be an integer >= 1 (got 2.0)"),
    (Setup(gpus=8, global_batch=64.5), "global_batch must be an integer >= 1"),
    (Setup(gpus=8, scheduler=SchedulerSettings("WarmupDecayLR", total_steps=2.5)), "total_steps must be an integer"),
    (Setup(gpus=8, scheduler=SchedulerSettings("WarmupLR", warmup_steps=1.5)), "warmup_steps must be an integer"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_values_that_make_no_sense_are_refused_in_one_line(llama8b, setup, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        build(setup, llama8b)
    assert "\n" not in str(refused.value)
