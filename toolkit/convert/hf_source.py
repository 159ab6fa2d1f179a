"""A Hugging Face checkpoint directory, validated up front and read lazily.

Every safetensors header is parsed and checked against the file (sizes, offsets, truncation)
before any tensor is read, so a broken file fails early. Tensors are read slice by slice with
`safe_open(...).get_slice`, and each file is opened per read so its mapping is released at once:
neither anonymous nor file-backed memory grows with the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.convert.jsonfile import read_json_object
from toolkit.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tokenizer and generation files copied verbatim next to converted checkpoints.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)

# safetensors dtype -> (torch dtype name, bytes per element)
_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
FLOAT_DTYPES = ("F32", "F16", "BF16")
_SAFETENSORS_CODE = {_DTYPES[code][0]: code for code in FLOAT_DTYPES}  # "bfloat16" -> "BF16"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file
    # The dtype of the bytes in the file where reading converts them to `dtype` (FP8 weights dequantized
    # to bf16: toolkit/convert/fp8.py), so they are never copied as they are; None: stored as `dtype`
    stored: str | None = None

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][1]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, _DTYPES[self.dtype][0])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def config_dtype(cfg: dict) -> str | None:
    """The weights' dtype config.json declares (transformers 5 writes `dtype`, older ones `torch_dtype`)."""
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return None if value in (None, "auto") else str(value)


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(f"{directory} has no config.json: is this a Hugging Face model directory?")
    return read_json_object(path)


def _dims(shape) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(shape)
    return tuple(shape)


def _offsets(offsets) -> tuple[int, int]:
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        raise ValueError(offsets)
    return offsets[0], offsets[1]


def parse_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Read and check a safetensors header without trusting it: every tensor must lie inside the
    file, have the byte size its dtype and shape imply, and not overlap another one."""
    if not path.is_file():
        raise ConversionError(f"{path} is not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConversionError(f"{path} is truncated: shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ConversionError(f"{path} has a corrupt or truncated header (claims {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConversionError(f"{path} has a header that is not valid JSON") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: the safetensors header is not a JSON object")
    data_size = size - 8 - header_len
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], _dims(info["shape"]), _offsets(info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConversionError(f"{path}: malformed header entry for {name!r}") from None
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * _DTYPES[dtype][1]:
            raise ConversionError(f"{path}: tensor {name!r} offsets [{begin}, {end}) do not match its shape {list(shape)}")
        if end > data_size:
            raise ConversionError(f"{path} is truncated: tensor {name!r} ends at byte {end} of a {data_size}-byte data section")
        entries[name] = TensorEntry(path, dtype, shape, 8 + header_len + begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ConversionError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return entries


def read_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{index}: weight_map must map tensor names to file names")
    for file in weight_map.values():
        if Path(file).name != file or file in (".", ".."):
            raise ConversionError(f"{index} names a file outside its directory: {file!r}")
    return weight_map


def _kept_in_float32(name: str, entry: TensorEntry, kept: tuple[str, ...]) -> bool:
    """A tensor transformers keeps in float32 among weights of another dtype, stored so (`kept`: the HF name
    suffixes of the family's rows that say so, Family.float32_suffixes; toolkit/families/float32.py)."""
    return entry.dtype == "F32" and name.endswith(kept)


def weights_dtype(tensors: dict[str, TensorEntry], kept: tuple[str, ...] = ()) -> torch.dtype:
    """The one dtype of the weights (check_weight_dtypes), the float32 tensors `kept` aside."""
    weights = [e for n, e in tensors.items() if not _kept_in_float32(n, e, kept)]
    return (weights or list(tensors.values()))[0].torch_dtype


def stored_dtype(tensors: dict[str, TensorEntry], suffix: str) -> torch.dtype | None:
    """The one dtype the tensors named `...suffix` are stored in (check_weight_dtypes); None: there are none."""
    return next((e.torch_dtype for n, e in tensors.items() if n.endswith(suffix)), None)


def check_weight_dtypes(tensors: dict[str, TensorEntry], config_dtype: str | None, kept: tuple[str, ...] = ()) -> None:
    """Floating-point weights only, all of the dtype config.json declares (or of one dtype when
    it declares none): a header that relabels bf16 bytes as int16 or float16 is refused. The tensors
    transformers keeps in float32 (`kept`: HF name suffixes, Family.float32_suffixes) may be float32
    instead, all of a suffix in one dtype: converted as stored."""
    expected = _SAFETENSORS_CODE.get(config_dtype) if config_dtype else None
    if config_dtype and expected is None:
        raise ConversionError(f"config.json declares dtype {config_dtype!r}, which is not a floating-point weight "
                              f"type ({', '.join(_SAFETENSORS_CODE)})")
    for name, entry in sorted(tensors.items()):
        if entry.dtype not in FLOAT_DTYPES:
            raise ConversionError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; only floating-point "
                                  f"weights ({', '.join(FLOAT_DTYPES)}) can be converted")
        if _kept_in_float32(name, entry, kept):
            continue  # converted as stored: rounding the router or its expert bias would change which experts are chosen
        expected = expected or entry.dtype
        if entry.dtype != expected:
            declared = f"config.json says dtype {config_dtype}" if config_dtype else f"other tensors are {expected}"
            raise ConversionError(f"{entry.file}: tensor {name!r} is {entry.dtype} but {declared}: the header or "
                                  "config.json is wrong; re-save the model with save_pretrained")
    for suffix in kept:
        stored = sorted((n, e.dtype) for n, e in tensors.items() if n.endswith(suffix))
        if len({d for _, d in stored}) > 1:
            (one, first), (other, second) = stored[0], next(x for x in stored if x[1] != stored[0][1])
            raise ConversionError(f"tensor {one!r} is {first} but {other!r} is {second}: transformers saves every "
                                  f"`{suffix.lstrip('.')}` of a model in one dtype; re-save the model with save_pretrained")


class HFCheckpoint:
    """A validated HF checkpoint: config, the tensor index, and lazy slice reads."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir} is not a directory")
        self.config = read_config(self.dir)
        self.config_bytes = (self.dir / "config.json").read_bytes()
        self.tensors = self._index()

    def _weight_files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            self._weight_map = read_weight_map(index)
            files = sorted({self.dir / f for f in self._weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConversionError(f"{index} names missing files: {', '.join(missing)}")
            return files
        self._weight_map = None
        files = sorted(self.dir.glob("*.safetensors"))
        if files:
            return files
        if list(self.dir.glob("*.bin")) or list(self.dir.glob("*.pt")):
            raise ConversionError(
                f"{self.dir} holds only pickled .bin/.pt weights; they are not loaded because unpickling "
                "untrusted files can run code. Re-save them as safetensors first "
                "(AutoModelForCausalLM.from_pretrained(...).save_pretrained(dir))."
            )
        raise ConversionError(f"{self.dir} contains no weights (*.safetensors)")

    def _index(self) -> dict[str, TensorEntry]:
        tensors: dict[str, TensorEntry] = {}
        for path in self._weight_files():
            for name, entry in parse_safetensors_header(path).items():
                if name in tensors:
                    raise ConversionError(f"tensor {name!r} appears in both {tensors[name].file.name} and {path.name}")
                tensors[name] = entry
        if self._weight_map is not None:
            for name, file in self._weight_map.items():
                if name not in tensors or tensors[name].file.name != file:
                    raise ConversionError(f"{INDEX_FILE} places {name!r} in {file}, but that file does not hold it")
        return tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        from safetensors import safe_open

        entry = self.tensors[name]
        with safe_open(entry.file, framework="pt") as f:
            view = f.get_slice(name)
            if rows is None and cols is None:
                return view[:]
            if cols is None:
                return view[rows]
            return view[rows if rows is not None else slice(None), cols]

    def tokenizer_files(self) -> list[Path]:
        return [self.dir / n for n in TOKENIZER_FILES if (self.dir / n).is_file()]
