"""Public DeepSpeed configs that popular projects ship: `check` agrees with DeepSpeed on every one.

tests/data/public_ds_configs/ holds configs copied verbatim from axolotl, LLaMA-Factory,
transformers' tests, Accelerate's templates and tests, FastChat, ms-swift and DeepSpeedExamples
(SOURCES.md names the repository, path and commit of each). A config with "auto" values is for
the HF Trainer / Accelerate: it is filled by their own code first (toolkit.dsconfig.hf_fill), then
DeepSpeed's parser judges the filled config. `check --hf-trainer` must refuse exactly the configs
that fail in that pipeline.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ds_oracle import oracle  # noqa: F401 - fixture
from toolkit.dsconfig import check

PUBLIC = Path(__file__).resolve().parent / "data" / "public_ds_configs"
FILES = sorted(PUBLIC.glob("*.json"))
GPUS = 8  # one node, data parallel: what these configs are written for


def load(name: str) -> dict:
    return json.loads((PUBLIC / name).read_text())


def uses_auto(node) -> bool:
    if isinstance(node, dict):
        return any(uses_auto(v) for v in node.values())
    return node == "auto"


def test_a_dozen_public_configs_each_with_its_source_named():
    sources = (PUBLIC / "SOURCES.md").read_text()
    assert len(FILES) >= 12
    for path in FILES:
        assert f"`{path.name}`" in sources, f"{path.name} has no source in SOURCES.md"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_check_agrees_with_deepspeed_after_the_hf_fill(path, oracle):
    from toolkit.dsconfig.hf_fill import fill

    raw = json.loads(path.read_text())
    hf = uses_auto(raw)
    report = check(copy.deepcopy(raw), gpus=GPUS, hf_trainer=hf)
    filled = fill(copy.deepcopy(raw), world_size=GPUS) if hf else None
    config = filled.config if filled and filled.config is not None else raw
    deepspeed_runs = (filled is None or filled.ok) and oracle.accepts(config, GPUS)
    assert report.ok == deepspeed_runs, ("\n".join(report.lines()), filled and filled.problems,
                                         oracle.error(config, GPUS))


def test_trainer_filled_scheduler_autos_are_accepted():
    """warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps: the Trainer fills them."""
    for name in ("transformers-ds_config_zero2.json", "ms-swift-zero2.json"):
        report = check(load(name), gpus=GPUS, hf_trainer=True)
        assert report.ok, "\n".join(report.lines())


def test_accelerate_filled_gather_16bit_auto_is_accepted():
    report = check(load("accelerate-zero_stage3_offload_config.json"), gpus=GPUS, hf_trainer=True)
    assert report.ok, "\n".join(report.lines())


def test_auto_that_neither_fills_is_refused_naming_each_key():
    """FastChat's ZeRO-3 file: Accelerate raises on "auto" in keys nobody fills (and the misspelt
    micro-batch key is silently ignored by DeepSpeed)."""
    report = check(load("fastchat-deepspeed_config_s3.json"), gpus=GPUS, hf_trainer=True)
    refused = {p.path for p in report.errors if p.kind == "auto-value"}
    assert refused == {"zero_optimization.sub_group_size", "zero_optimization.stage3_max_live_parameters",
                       "zero_optimization.stage3_max_reuse_distance", "micro_batch_size_per_gpu"}
    assert all("Accelerate" in p.message for p in report.errors if p.kind == "auto-value")


def test_comment_keys_are_a_warning_not_an_error(oracle):
    config = load("axolotl-zero3_bf16.json")
    config["_comment"] = "ZeRO-3 for the HF Trainer"
    config["zero_optimization"] = dict(config["zero_optimization"])
    report = check(config, gpus=GPUS, hf_trainer=True)
    assert report.ok, "\n".join(report.lines())
    assert [(p.kind, p.path) for p in report.warnings] == [("comment-key", "_comment")]
    plain = load("deepspeedexamples-zenflow-zf_config.json") | {"_comment": "see README"}
    assert check(plain, gpus=GPUS).ok and oracle.accepts(plain, GPUS)


def test_what_the_trainer_or_accelerate_refuses_is_an_error():
    contradicts = load("transformers-ds_config_zero2.json")
    contradicts["optimizer"]["params"]["lr"] = 1e-4
    contradicts["scheduler"]["params"]["warmup_max_lr"] = 3e-5  # the Trainer has one learning_rate for both
    report = check(contradicts, gpus=GPUS, hf_trainer=True)
    assert [(p.kind, p.path) for p in report.errors] == [("hf-mismatch", "scheduler.params.warmup_max_lr")]
    no_zero = {k: v for k, v in load("ms-swift-zero2.json").items() if k != "zero_optimization"}
    report = check(no_zero, gpus=GPUS, hf_trainer=True)
    assert [p.kind for p in report.errors] == ["hf-fill"]
    assert "Please specify the ZeRO optimization config" in report.errors[0].message


def test_a_block_of_the_wrong_type_is_reported_not_a_crash_of_the_fill():
    for block, value in (("fp16", True), ("zero_optimization", []), ("optimizer", "AdamW")):
        report = check(load("ms-swift-zero2.json") | {block: value}, gpus=GPUS, hf_trainer=True)
        assert {(p.kind, p.path) for p in report.errors} == {("wrong-type", block), ("hf-fill", "")}


def _leaves(node, path=""):
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, f"{path}.{key}" if path else key)]
    return [path]


def _set(config: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        config = config[part]
    config[last] = value


AUTO_BASES = ["transformers-ds_config_zero3.json", "llamafactory-ds_z2_config.json",
              "deepspeedexamples-zenflow-zf_config.json"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_hf_config_check_accepts_runs_through_the_fill_and_deepspeed(oracle, data):
    """"auto" written anywhere: what check --hf-trainer accepts, the Trainer / Accelerate fill and
    DeepSpeed's parser accept too (check may refuse more: what DeepSpeed lets through and fails later)."""
    from toolkit.dsconfig.hf_fill import fill

    config = load(data.draw(st.sampled_from(AUTO_BASES)))
    for path in data.draw(st.lists(st.sampled_from(_leaves(config)), max_size=4, unique=True)):
        _set(config, path, "auto")
    if check(copy.deepcopy(config), gpus=GPUS, hf_trainer=True).ok:
        filled = fill(config, world_size=GPUS)
        assert filled.ok and oracle.accepts(filled.config, GPUS), (config, oracle.error(filled.config, GPUS))
