"""ds_configs/: regenerated from their commands without drift, and accepted by DeepSpeed itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.ds_oracle import oracle  # noqa: F401 - fixture
from toolkit.dsconfig import check
from toolkit.dsconfig.examples import EXAMPLES, regenerate
from toolkit.modelspec import read

ROOT = Path(__file__).resolve().parents[1]
DS_CONFIGS = ROOT / "ds_configs"


def test_regenerating_every_example_reproduces_ds_configs_byte_for_byte(tmp_path, monkeypatch):
    shutil.copytree(DS_CONFIGS / "models", tmp_path / "ds_configs" / "models")
    monkeypatch.chdir(tmp_path)  # the commands use repo-relative paths, which end up in the files
    written = regenerate("ds_configs")
    committed = {p.relative_to(DS_CONFIGS) for p in DS_CONFIGS.rglob("*") if p.is_file() and "models" not in p.parts}
    assert {p.relative_to("ds_configs") for p in written} == committed, "ds_configs/ has files no example makes"
    for path in written:
        assert path.read_text() == (ROOT / path).read_text(), f"{path} drifted: run python -m toolkit.dsconfig.examples"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if "--hf-trainer" not in e.args], ids=lambda e: e.name)
def test_every_example_is_accepted_by_deepspeed_at_its_data_parallel_size(example, oracle):
    """NVMe offload is parse-checked only: building it needs DeepSpeed's async I/O op, whose
    libaio headers this machine lacks."""
    config = json.loads((DS_CONFIGS / f"{example.name}.json").read_text())
    gpus, tp, pp = example.gpus, example.tp, example.pp
    assert oracle.error(config, gpus // (tp * pp)) is None
    assert oracle.error(config, 2 * gpus // (tp * pp)) is not None
    assert check(config, gpus=gpus, tp=tp, pp=pp).problems == []


def test_hf_trainer_example_is_filled_by_transformers_and_then_accepted(oracle):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    raw = json.loads((DS_CONFIGS / "hf-trainer-zero3-8gpu.json").read_text())
    assert check(raw, gpus=8, hf_trainer=True).problems == []
    hf = HfTrainerDeepSpeedConfig(raw)
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                             bf16=True, learning_rate=2e-5, report_to=[], use_cpu=True)
    hf.trainer_config_process(args)  # a mismatch with TrainingArguments would raise here

    class Model:
        class config:  # noqa: N801 - what transformers reads
            hidden_size = read(DS_CONFIGS / "models" / "llama-3-8b").hidden_size

    hf.trainer_config_finalize(args, Model(), 1000)
    # this process is a world of one, which is what the HF Trainer computed the batch for
    assert oracle.error(hf.config, args.world_size) is None
    assert hf.config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)


def test_accelerate_config_points_at_the_json_and_loads_in_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(DS_CONFIGS / "hf-trainer-zero3-8gpu.accelerate.yaml"))
    assert config.distributed_type == "DEEPSPEED"
    assert config.num_processes == 8
    assert config.deepspeed_config == {"deepspeed_config_file": "ds_configs/hf-trainer-zero3-8gpu.json",
                                       "zero3_init_flag": True}
