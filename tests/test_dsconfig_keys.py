"""The key tables `check` uses are the keys DeepSpeed actually reads.

DeepSpeedConfig is run on dicts that record every key looked up in them (get, [], in, keys()).
The recorded sets must equal our tables, so a DeepSpeed upgrade that reads a new key (which
`check` would then call a typo) or stops reading one (a typo `check` would then miss) fails here.
"""

from __future__ import annotations

import inspect
import logging
import re

import pytest

from tests.ds_oracle import cpu_accelerator_in_this_process
from toolkit.dsconfig import keys


def recording(name: str, data: dict, seen: dict) -> dict:
    class Recorder(dict):
        def _saw(self, key):
            seen.setdefault(name, set()).add(key)

        def get(self, key, default=None):
            self._saw(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self._saw(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self._saw(key)
            return super().__contains__(key)

        def keys(self):
            outer = self

            class Keys:
                def __contains__(self, key):
                    outer._saw(key)
                    return dict.__contains__(outer, key)

                def __iter__(self):
                    return iter(dict.keys(outer))

            return Keys()

        def __copy__(self):
            return self

    return Recorder(data)


@pytest.fixture(scope="module")
def read_keys() -> dict[str, set]:
    cpu_accelerator_in_this_process()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    seen: dict[str, set] = {}
    plain = [b for b in keys.BLOCK_KEYS if b not in ("optimizer", "scheduler", "checkpoint", "pipeline")]
    config = {"train_micro_batch_size_per_gpu": 1}
    config.update({block: recording(block, {}, seen) for block in plain})
    config["optimizer"] = recording("optimizer", {"type": "AdamW", "params": {}}, seen)
    config["scheduler"] = recording("scheduler", {"type": "WarmupLR", "params": {}}, seen)
    config["checkpoint"] = recording("checkpoint", {"parallel_write": recording("checkpoint.parallel_write", {}, seen)},
                                     seen)
    DeepSpeedConfig(recording("", config, seen))
    return seen


def test_top_level_keys_are_those_deepspeed_config_reads(read_keys):
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS

    # Read in deepspeed/__init__.py (device mesh); DeepSpeedConfig reads sequence_parallel_size
    # too, but only once a process group exists and no mpu is given.
    mesh = {"sequence_parallel_size", "data_parallel_size"}
    assert read_keys[""] - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) - mesh == set(keys.TOP_LEVEL) - mesh
    source = inspect.getsource(__import__("deepspeed").initialize)
    assert all(f'"{key}"' in source for key in mesh)


@pytest.mark.parametrize("block", [b for b in keys.BLOCK_KEYS if b != "pipeline"])
def test_plain_block_keys_are_those_deepspeed_reads(read_keys, block):
    assert read_keys.get(block, set()) == set(keys.BLOCK_KEYS[block])


def test_pipeline_keys_are_the_defaults_and_what_the_pipeline_engine_reads():
    from deepspeed.runtime import config
    from deepspeed.runtime.pipe import engine

    defaults = set(re.findall(r'"(\w+)":', inspect.getsource(config.get_pipeline_config)))
    used = set(re.findall(r"pipeline\['(\w+)'\]", inspect.getsource(engine)))
    assert defaults | used == set(keys.BLOCK_KEYS["pipeline"])


def test_nested_keys(read_keys):
    for path, table in keys.NESTED_KEYS.items():
        assert read_keys[path] == set(table)


def test_validated_blocks_are_pydantic_models_that_forbid_extra_keys():
    from toolkit.dsconfig.pydantic_blocks import models

    for path, model in models().items():
        assert model.model_config.get("extra") == "forbid", path
    assert set(keys.VALIDATED_BLOCKS) <= set(models())
