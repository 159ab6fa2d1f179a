"""`check` rejects each kind of bad config with an actionable message, and agrees with DeepSpeed.

Each case starts from a generated config that both `check` and DeepSpeed accept, breaks one
thing, and records what DeepSpeed's own parser (DeepSpeedConfig, with the right DP size) does
with the result: "rejects" where DeepSpeed also refuses it, "accepts" where DeepSpeed lets it
through and the job would misbehave later (a silently ignored key, an assertion in
deepspeed.initialize, a TypeError at the first step). If DeepSpeed's behaviour changes, the
recorded verdict fails and the table must be revisited.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ds_oracle import oracle  # noqa: F401 - fixture
from toolkit.dsconfig import SchedulerSettings, Setup, build, check
from toolkit.modelspec import read

MODELS = Path(__file__).resolve().parents[1] / "ds_configs" / "models"
SPEC = read(MODELS / "llama-3-8b")

# 8 GPUs at TP 2: DP 4. Batch 32 = micro 2 x accumulation 4 x DP 4.
LAYOUT = dict(gpus=8, tp=2, pp=1)
COSINE = SchedulerSettings("WarmupCosineLR", warmup_steps=10, total_steps=1000)
BASE = {
    1: build(Setup(gpus=8, tp=2, zero=1, micro_batch=2, global_batch=32, scheduler=COSINE), SPEC),
    3: build(Setup(gpus=8, tp=2, zero=3, micro_batch=2, global_batch=32, scheduler=COSINE), SPEC),
}
NAN, INF = float("nan"), float("inf")


def put(path: str, value):
    def mutate(config):
        *parents, last = path.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return mutate


def drop(*paths: str):
    def mutate(config):
        for path in paths:
            *parents, last = path.split(".")
            node = config
            for part in parents:
                node = node[part]
            node.pop(last, None)
    return mutate


def both(*mutations):
    def mutate(config):
        for m in mutations:
            m(config)
    return mutate


# (kind, base stage, mutation, layout overrides, message fragment, DeepSpeedConfig's verdict)
CASES = {
    "top-level typo": ("unknown-key", 1, put("gradient_cliping", 0.5), {}, "did you mean 'gradient_clipping'", "accepts"),
    "typo in activation_checkpointing": ("unknown-block-key", 1, put("activation_checkpointing.partitioned_activations", True),
                                         {}, "did you mean 'partition_activations'", "accepts"),
    "typo in flops_profiler": ("unknown-block-key", 1, put("flops_profiler.profile_stepp", 3), {},
                               "did you mean 'profile_step'", "accepts"),
    "zero key at top level": ("unknown-key", 3, put("stage3_prefetch_bucket_size", 1000), {},
                              "belongs inside 'zero_optimization'", "accepts"),
    "typo in zero_optimization": ("invalid-field", 1, put("zero_optimization.overlap_com", True), {},
                                  "did you mean 'overlap_comm'", "rejects"),
    "string number in zero": ("string-number", 1, put("zero_optimization.reduce_bucket_size", "5e8"), {},
                              "write 500000000", "rejects"),
    "string number at top level": ("string-number", 1, put("gradient_clipping", "1.0"), {}, "write the number 1",
                                   "accepts"),
    "fractional bucket size": ("fractional-integer", 3, put("zero_optimization.stage3_prefetch_bucket_size", 15099494.4),
                               {}, "write 15099494", "rejects"),
    "auto outside the HF Trainer": ("auto-value", 1, put("train_batch_size", "auto"), {}, "fails later", "rejects"),
    "auto silently dropped": ("auto-value", 3, put("zero_optimization.reduce_bucket_size", "auto"), {},
                              "silently drops it", "accepts"),
    "batch mismatch": ("batch-mismatch", 1, put("train_batch_size", 100), {}, "2 x 4 x 4 = 32", "rejects"),
    "config for the GPU count, not DP": ("batch-mismatch", 1, put("train_batch_size", 64), {}, "not the GPU count",
                                         "rejects"),
    "no batch size": ("batch-missing", 1, drop("train_batch_size", "train_micro_batch_size_per_gpu"), {},
                      "give train_batch_size", "rejects"),
    # No data-parallel size exists for this layout, so DeepSpeed has nothing to be asked (None).
    "GPUs not divisible by TP x PP": ("layout", 1, lambda c: None, {"gpus": 12, "tp": 8}, "12 % 8 = 4", None),
    "ZeRO-2 with PP": ("pipeline-zero", 1, put("zero_optimization.stage", 2), {"pp": 2, "gpus": 16},
                       "ZeRO-2 cannot be combined with pipeline parallelism", "accepts"),
    "ZeRO-3 with PP": ("pipeline-zero", 3, lambda c: None, {"pp": 2, "gpus": 16}, "ZeRO-3 cannot", "accepts"),
    "bf16 with fp16": ("bf16-and-fp16", 1, put("fp16", {"enabled": True}), {}, "cannot both be enabled", "rejects"),
    "fp16 keys under bf16": ("fp16-key-under-bf16", 1, put("bf16.loss_scale_window", 1000), {}, "no loss scaling",
                             "rejects"),
    "parameter offload below ZeRO-3": ("offload-stage", 1, put("zero_optimization.offload_param", {"device": "cpu"}),
                                       {}, "needs ZeRO-3", "accepts"),
    "NVMe optimizer offload below ZeRO-3": ("offload-stage", 1, put("zero_optimization.offload_optimizer",
                                                                     {"device": "nvme", "nvme_path": "/nvme"}),
                                            {}, "silently treats it as CPU offload", "accepts"),
    "offload without ZeRO": ("offload-stage", 1, both(put("zero_optimization", {"stage": 0, "offload_optimizer":
                                                                                  {"device": "cpu"}})),
                             {}, "offload needs ZeRO", "accepts"),
    "removed feature": ("removed-key", 1, put("elasticity", {"enabled": True}), {}, "Elastic training has been removed",
                        "rejects"),
    "unknown optimizer": ("unknown-optimizer", 1, put("optimizer.type", "AdamWW"), {}, "neither a DeepSpeed optimizer",
                          "accepts"),
    "typo in optimizer params": ("optimizer-param", 1, put("optimizer.params.beta1", 0.9), {}, "did you mean 'betas'",
                                 "accepts"),
    "max_grad_norm as optimizer param": ("optimizer-param", 1, put("optimizer.params.max_grad_norm", 1.0), {},
                                         "gradient_clipping", "accepts"),
    "untested optimizer with ZeRO": ("untested-optimizer", 1, put("optimizer", {"type": "SGD", "params": {"lr": 0.1}}),
                                     {}, "zero_allow_untested_optimizer", "accepts"),
    "no warmup written as 0 steps": ("scheduler", 1, put("scheduler.params.warmup_num_steps", 0), {},
                                    "positive integer", "accepts"),
    "typo in scheduler params": ("scheduler", 1, put("scheduler.params.warmup_num_step", 10), {},
                                 "did you mean 'warmup_num_steps'", "accepts"),
    "unmanaged accumulation with overlap below ZeRO-2": (
        "unmanaged-accumulation", 1,
        both(put("managed_gradient_accumulation", False), put("zero_optimization.overlap_comm", True)), {},
        "overlap_comm=false", "accepts"),
    "unmanaged accumulation with accumulation steps": (
        "unmanaged-accumulation", 1, put("managed_gradient_accumulation", False), {},
        "divide every gradient by it", "accepts"),
    "fp32 accumulation at ZeRO-0": ("grad-accum-dtype", 1, both(put("zero_optimization", {"stage": 0}),
                                                               put("data_types.grad_accum_dtype", "fp32")),
                                    {}, "NotImplementedError", "accepts"),
    "wrong type": ("wrong-type", 1, put("memory_breakdown", "false"), {}, "expected bool", "accepts"),  # truthy!
    "sum all-reduce with ZeRO-3": ("incompatible-options", 3, put("gradient_allreduce_op", "sum"), {},
                                   "not supported with ZeRO-3", "rejects"),
    # Values that make no sense: DeepSpeedConfig lets most through, the optimizer or the first step fails.
    "NaN learning rate": ("out-of-range", 1, put("optimizer.params.lr", NAN), {}, "finite number >= 0 (got nan)",
                          "accepts"),
    "negative learning rate": ("out-of-range", 1, put("optimizer.params.lr", -1e-5), {}, "finite number >= 0",
                               "accepts"),
    "betas of length 1": ("out-of-range", 1, put("optimizer.params.betas", [0.9]), {}, "betas must be 2 numbers",
                          "accepts"),
    "beta of 1": ("out-of-range", 1, put("optimizer.params.betas", [0.9, 1.0]), {}, ">= 0 and < 1", "accepts"),
    "negative clipping": ("out-of-range", 1, put("gradient_clipping", -1.0), {}, "finite number >= 0", "accepts"),
    "infinite batch": ("non-finite", 1, put("train_batch_size", INF), {}, "must be a finite integer", "rejects"),
    "NaN batch": ("non-finite", 1, put("train_micro_batch_size_per_gpu", NAN), {}, "must be a finite integer",
                  "rejects"),
    "fractional total steps": ("out-of-range", 1, put("scheduler.params.total_num_steps", 2.5), {},
                               "must be an integer >= 1 (got 2.5)", "accepts"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_check_rejects_each_kind_of_bad_config(name, oracle):
    kind, stage, mutate, layout, fragment, deepspeed = CASES[name]
    config = copy.deepcopy(BASE[stage])
    mutate(config)
    layout = {**LAYOUT, **layout}
    report = check(config, **layout)
    mine = [p for p in report.errors if p.kind == kind]
    assert mine, "\n".join(report.lines())
    assert any(fragment in p.message for p in mine), "\n".join(report.lines())
    if deepspeed is None:
        return
    dp = layout["gpus"] // (layout["tp"] * layout["pp"])
    verdict = "accepts" if oracle.accepts(config, dp) else "rejects"
    assert verdict == deepspeed, oracle.error(config, dp)


def test_at_least_twelve_kinds_are_covered():
    assert len({case[0] for case in CASES.values()}) >= 12


def test_duplicate_keys_in_a_file_are_reported_like_deepspeed_refuses_them(tmp_path, oracle):
    path = tmp_path / "dup.json"
    text = json.dumps(BASE[1], indent=1)
    path.write_text(text.replace('"steps_per_print": 100,', '"steps_per_print": 100,\n "steps_per_print": 10,'))
    report = check(path, **LAYOUT)
    assert [p.kind for p in report.errors] == ["duplicate-key"]
    assert not oracle.accepts(str(path), 4)


def test_generated_configs_pass_check_and_auto_is_allowed_for_the_hf_trainer():
    for config in BASE.values():
        assert check(config, **LAYOUT).problems == []
    hf = build(Setup(gpus=8, zero=3, hf_trainer=True), SPEC)
    assert check(hf, gpus=8, hf_trainer=True).ok
    assert "auto-value" in check(hf, gpus=8).kinds()


def test_missing_pins_are_warnings_not_errors():
    config = copy.deepcopy(BASE[1])
    del config["gradient_clipping"], config["zero_optimization"]["overlap_comm"]
    report = check(config, **LAYOUT)
    assert report.ok
    assert {p.path for p in report.warnings} == {"gradient_clipping", "zero_optimization.overlap_comm"}


# Mutations a hand-edited config typically goes through; hypothesis combines them at random.
MUTATIONS = [
    put("train_batch_size", 64), put("train_batch_size", 16), put("gradient_accumulation_steps", 2),
    put("train_micro_batch_size_per_gpu", 4), drop("gradient_accumulation_steps"), drop("train_batch_size"),
    put("zero_optimization.stage", 2), put("zero_optimization.stage", 0), put("zero_optimization.stage", 3),
    put("fp16", {"enabled": True}), put("bf16", {"enabled": False}), put("bf16.loss_scale", 0),
    put("zero_optimization.reduce_bucket_size", "5e8"), put("zero_optimization.reduce_bucket_size", 1e6 + 0.5),
    put("zero_optimization.offload_optimizer", {"device": "cpu"}), put("zero_optimization.offload_param", {"device": "cpu"}),
    put("managed_gradient_accumulation", False), put("gradient_clipping", "auto"), put("optimizer.params.lr", "auto"),
    put("zero_optimization.stage3_max_live_parameters", "1e9"), put("fp16.loss_scale_window", 0),
    put("gradient_allreduce_op", "sum"), put("communication_data_type", "int8"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stage=st.sampled_from([1, 3]), picks=st.lists(st.integers(0, len(MUTATIONS) - 1), max_size=4),
       gpus=st.sampled_from([4, 8, 16]), tp=st.sampled_from([1, 2]))
def test_every_config_check_accepts_is_accepted_by_deepspeed(oracle, stage, picks, gpus, tp):
    config = copy.deepcopy(BASE[stage])
    for i in picks:
        MUTATIONS[i](config)
    report = check(config, gpus=gpus, tp=tp)
    if report.ok:
        assert oracle.accepts(config, gpus // tp), (picks, oracle.error(config, gpus // tp))
