"""What travels with a converted checkpoint, so export never needs the original HF directory.

    OUT/
      latest_checkpointed_iteration.txt   "release" (Megatron-LM's tracker file)
      release/                            per-rank mp_rank_TT[_PPP]/model_optim_rng.pt, or torch_dist files
      hf/                                 byte copies of config.json and the tokenizer files
      toolkit_checkpoint.json             layout, true vocab, dtype, model spec, checksum of every file
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit import __version__
from toolkit.checksum import file_digest, is_recorded_digest, matches
from toolkit.convert.jsonfile import read_json_object
from toolkit.convert.naming import LAYER_SPECS
from toolkit.errors import ConversionError
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout

META_FILE = "toolkit_checkpoint.json"
HF_DIR = "hf"
RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
FORMATS = ("torch", "torch_dist")
# JSON value types accepted for a dataclass field annotated with this name.
_JSON_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "dict": (dict,)}


def _has_type(value, annotation: str) -> bool:
    if value is None:
        return "None" in annotation
    kinds = [k for k in annotation.split(" | ") if k != "None"]
    # bool is an int in Python, but `"tp": true` is not a tensor-parallel size
    return any(type(value) in _JSON_TYPES[k] and (k == "bool" or type(value) is not bool) for k in kinds)


def check_fields(cls, data: dict, where: str) -> None:
    """Refuse unknown, missing or mistyped keys of a dataclass read back from JSON, in one line."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConversionError(f"{where} has an unknown key {unknown[0]!r} (edited, or written by another version?)")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data:
            if required:
                raise ConversionError(f"{where} has a missing key {name!r}")
            continue
        if not _has_type(data[name], f.type):
            raise ConversionError(f"{where}: {name!r} must be {f.type}, not {data[name]!r}")


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
    ep: int = 1  # expert-parallel size (Mixture-of-Experts)
    # The HF model directory this was converted from: an exported LoRA adapter's base_model_name_or_path
    # (AutoPeftModelForCausalLM loads the base from there), unless the recipe names another.
    hf_source: str | None = None
    # A training run's fp32 master weights (toolkit.train.checkpoint), exported in spec.dtype with the tensors
    # transformers keeps in float32 as the installed class keeps them; False: a conversion, every tensor as
    # the HF checkpoint stored it (toolkit/families/float32.py)
    master_weights: bool = False
    # kind -> how many of the HF checkpoint's tensors the conversion left out as HF's model ignores them on
    # load (toolkit/convert/ignored.py): what the export says it does not write
    ignored: dict = field(default_factory=dict)

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec.from_dict(self.spec)

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.vocab_divisor, self.ep)

    def write(self, directory: Path) -> None:
        (directory / META_FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        path = directory / META_FILE
        if not path.exists():
            raise ConversionError(f"{directory} has no {META_FILE}: not a checkpoint written by this toolkit")
        data = read_json_object(path)
        check_fields(cls, data, str(path))
        check_fields(ModelSpec, data["spec"], f"{path} (spec)")
        for key, allowed in (("format", FORMATS), ("layer_spec", LAYER_SPECS)):
            if data[key] not in allowed:
                raise ConversionError(f"{path}: {key} {data[key]!r} is not one of {', '.join(allowed)}")
        if not all(is_recorded_digest(v) for v in data["checksums"].values()):
            raise ConversionError(f"{path}: checksums must map file names to blake3 or sha256 digests")
        return cls(**data)


def checksum_tree(root: Path, under: str = RELEASE, known: dict[Path, str] | None = None) -> dict[str, str]:
    """The checksum of every file under root/under, by relative path; `known` digests (hashed as
    the files were written, by resolved path) are taken as they are."""
    known = known or {}
    return {
        str(p.relative_to(root)): known.get(p.resolve()) or file_digest(p)
        for p in sorted((root / under).rglob("*")) if p.is_file()
    }


def verify_file(root: Path, path: Path, checksums: dict[str, str]) -> None:
    """Refuse a file whose checksum differs from the one recorded at conversion (in the algorithm
    it was recorded with)."""
    key = str(path.relative_to(root))
    if key not in checksums:
        raise ConversionError(f"{path} is not recorded in {root / META_FILE}: a file that conversion did not write")
    if not matches(path, checksums[key]):
        raise ConversionError(f"{path} does not match the checksum recorded in {META_FILE}: it was changed or damaged "
                              "after conversion; restore it or convert again")


def check_file_set(root: Path, under: Path, checksums: dict[str, str]) -> None:
    """The files under `under` are exactly the ones the metadata records there."""
    prefix = str(under.relative_to(root))
    recorded = {k for k in checksums if k.startswith(prefix + "/")}
    present = {str(p.relative_to(root)) for p in under.rglob("*") if not p.is_dir()} if under.is_dir() else set()
    if recorded - present:
        raise ConversionError(f"{root / min(recorded - present)} is missing or not a file (recorded in {META_FILE})")
    if present - recorded:
        raise ConversionError(f"{root / min(present - recorded)} is not recorded in {META_FILE}: "
                              "a file that conversion did not write")


def bad_checksums(root: Path, meta: CheckpointMeta) -> list[str]:
    """Files whose checksum differs from the metadata, or that are missing or unexpected."""
    present = {str(p.relative_to(root)): p for p in sorted((root / RELEASE).rglob("*")) if p.is_file()}
    names = sorted(set(present) | set(meta.checksums))
    return [n for n in names if n not in present or n not in meta.checksums or not matches(present[n], meta.checksums[n])]


def copy_hf_files(config_bytes: bytes, tokenizer_files: list[Path], dest: Path) -> None:
    dest.mkdir()
    (dest / "config.json").write_bytes(config_bytes)
    for f in tokenizer_files:
        shutil.copyfile(f, dest / f.name)
