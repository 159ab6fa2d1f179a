"""Communication overlap options: DeepSpeed's overlap_comm and reduce bucket where ZeRO uses them
(on by default at ZeRO-2/3, refused at ZeRO-1 under megatron-core's schedule, where DeepSpeed
asserts), megatron-core's p2p overlap only with the interleaved schedule, TP overlap refused
(Transformer Engine only); the recipe, `ds-config` and the memory estimate read the same rules.
The overlap's step-time effect is measured by benchmarks/overlap_bench.py."""

from __future__ import annotations

import pytest

from tests.finetune_harness import assert_refused_in_one_line, recipe_config
from tests.workers_memory import tiny_spec
from toolkit.dsconfig import Setup, build
from toolkit.errors import ConfigError


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.overlap_comm=true"], "DeepSpeed 0.19.8 asserts"),  # zero_stage 1, the recipe's default
        (["parallel.overlap_comm=true", "parallel.pp=2"], "DeepSpeed 0.19.8 asserts"),
        (["parallel.dp_engine=fsdp", "parallel.reduce_bucket_size=1000"], "ignores"),
        (["parallel.overlap_p2p_comm=true", "parallel.pp=2"], "needs the interleaved schedule"),
        (["parallel.tp_comm_overlap=true", "parallel.tp=2"], "Transformer Engine"),
    ],
)
def test_overlap_options_the_layout_ignores_are_refused_in_one_line(tmp_path, overrides, message):
    assert_refused_in_one_line(tmp_path, overrides, message)


def test_recipe_defaults_overlap_where_valid_and_passes_the_settings_to_deepspeed(tmp_path):
    from toolkit.train.build import ds_config

    zero = lambda *o: ds_config(recipe_config(tmp_path, list(o)), tiny_spec(), 2)["zero_optimization"]  # noqa: E731
    assert zero()["overlap_comm"] is False  # ZeRO-1
    assert zero("parallel.zero_stage=2")["overlap_comm"] is True
    assert zero("parallel.zero_stage=3")["overlap_comm"] is True
    chosen = zero("parallel.zero_stage=2", "parallel.overlap_comm=false", "parallel.reduce_bucket_size=4096")
    assert chosen["overlap_comm"] is False and chosen["reduce_bucket_size"] == 4096


def test_ds_config_and_memory_know_the_same_rules():
    from toolkit.memory import CPU_LOCAL, estimate

    spec = tiny_spec()
    for setup, message in ((Setup(gpus=2, zero=1, schedule="megatron", overlap_comm=True), "asserts"),
                           (Setup(gpus=2, zero=0, reduce_bucket_size=100), "ZeRO-0 ignores")):
        with pytest.raises(ConfigError, match=message):
            build(setup, spec)
        with pytest.raises(ConfigError, match=message):
            estimate(spec, setup, 32)
    # plain DeepSpeed accumulation may overlap at ZeRO-1; the estimate then holds two reduce buckets
    on, off = (estimate(spec, Setup(gpus=2, zero=1, overlap_comm=o, reduce_bucket_size=10**6), 32, kernels=CPU_LOCAL,
                        reserve=0).stages[0].states.buffers for o in (True, False))
    assert on - off == 2 * 10**6  # bf16 bytes of the second bucket
