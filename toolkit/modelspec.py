"""Read a ModelSpec from whatever the user points at: an HF model directory, a config.json, or a
checkpoint written by `toolkit convert hf-to-megatron` (which records the spec it was built from)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import ConfigError

if TYPE_CHECKING:
    from toolkit.families.spec import ModelSpec


def read(path: str | Path) -> "ModelSpec":
    from toolkit.convert.metadata import META_FILE, CheckpointMeta

    p = Path(path)
    if p.is_dir() and (p / META_FILE).is_file():
        return CheckpointMeta.read(p).model_spec
    config_file = p / "config.json" if p.is_dir() else p
    if not config_file.is_file():
        raise ConfigError(f"{path}: expected an HF model directory, a config.json, or a converted checkpoint")
    from toolkit.convert.hf_config import checked_spec
    from toolkit.convert.jsonfile import read_json_object

    # The checks `convert` makes (transformers' types, heads that divide), so that `memory` and
    # `plan` refuse in one line what `convert` refuses.
    return checked_spec(read_json_object(config_file), config_file)[1]
