"""What travels with a converted checkpoint, so export never needs the original HF directory.

    OUT/
      latest_checkpointed_iteration.txt   "release" (Megatron-LM's tracker file)
      release/                            per-rank mp_rank_TT[_PPP]/model_optim_rng.pt, or torch_dist files
      hf/                                 byte copies of config.json and the tokenizer files
      toolkit_checkpoint.json             layout, true vocab, dtype, model spec, sha256 of every file
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit import __version__
from toolkit.errors import ConversionError
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout

META_FILE = "toolkit_checkpoint.json"
HF_DIR = "hf"
RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


@dataclass
class CheckpointMeta:
    format: str  # "torch" or "torch_dist"
    layer_spec: str  # "te" or "local" (names used in per-rank torch files)
    tp: int
    pp: int
    vocab_divisor: int
    vocab_size: int
    padded_vocab_size: int
    spec: dict
    checksums: dict = field(default_factory=dict)
    toolkit_version: str = __version__

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec.from_dict(self.spec)

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.vocab_divisor)

    def write(self, directory: Path) -> None:
        (directory / META_FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        path = directory / META_FILE
        if not path.is_file():
            raise ConversionError(f"{directory} has no {META_FILE}: not a checkpoint written by this toolkit")
        return cls(**json.loads(path.read_text()))


def sha256(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checksum_tree(root: Path, under: str = RELEASE) -> dict[str, str]:
    return {
        str(p.relative_to(root)): sha256(p) for p in sorted((root / under).rglob("*")) if p.is_file()
    }


def bad_checksums(root: Path, meta: CheckpointMeta) -> list[str]:
    """Files whose sha256 differs from the metadata, or that are missing or unexpected."""
    actual = checksum_tree(root)
    names = sorted(set(actual) | set(meta.checksums))
    return [n for n in names if actual.get(n) != meta.checksums.get(n)]


def copy_hf_files(config_bytes: bytes, tokenizer_files: list[Path], dest: Path) -> None:
    dest.mkdir()
    (dest / "config.json").write_bytes(config_bytes)
    for f in tokenizer_files:
        shutil.copyfile(f, dest / f.name)
