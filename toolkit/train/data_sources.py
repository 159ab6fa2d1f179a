"""Where training records come from: data files and datasets as users bring them.

  *.jsonl                    read here line by line, so that a malformed line (bad JSON, invalid
                             UTF-8, a missing key) is named by file:line
  *.json *.parquet *.arrow   read by the `datasets` library (its packaged builders), cached under
  *.csv                      data.cache_dir (default RUN_DIR/data_cache, never the home directory)
  a directory                `save_to_disk` output (load_from_disk), or a directory of data files
  anything else              a Hugging Face Hub dataset name (load_dataset): the same code, and one
                             line when the Hub cannot be reached

The library reads; our own code tokenizes, masks, packs and orders (toolkit.train.data), so the
order is the same whatever the format. A record's columns are mapped to ours with data.columns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError


class DataError(ToolkitError):
    """A data file is missing, empty or malformed, or its data cannot train."""


BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
OUR_COLUMNS = ("prompt", "response", "messages", "text", "chosen", "rejected")


@dataclass(frozen=True)
class Source:
    """One data set: a path or Hub name, the split to read and, in a mixture, its weight."""

    name: str
    split: str = "train"
    weight: float = 1.0


def sources(names: str, weights: str | None, split: str) -> list[Source]:
    """data.train_file (several, comma-separated, form a mixture) with data.weights."""
    items = [n.strip() for n in names.split(",") if n.strip()]
    if not items:
        raise DataError("data.train_file is empty")
    if weights is None:
        return [Source(n, split) for n in items]
    try:
        values = [float(w) for w in str(weights).split(",")]
    except ValueError:
        raise DataError(f"data.weights={weights}: expected numbers, comma-separated") from None
    if len(values) != len(items):
        raise DataError(f"data.weights has {len(values)} values for {len(items)} data sets in data.train_file")
    if any(not w > 0 for w in values):
        raise DataError(f"data.weights={weights}: every weight must be above 0")
    return [Source(n, split, w) for n, w in zip(items, values)]


def records(source: Source, columns: dict[str, str], cache_dir: Path) -> Iterator[tuple[str, object]]:
    """(where, record) in the data set's order; `where` names the file and line or row."""
    path = Path(source.name)
    if path.suffix == ".jsonl" or (path.is_file() and path.suffix not in BUILDERS):
        if source.split != "train":
            raise DataError(f"{path} is one file: it has no split {source.split!r} (give another file)")
        yield from _jsonl(path, columns)
        return
    table = _load(source, cache_dir)
    unknown = sorted({theirs for theirs in columns.values()} - set(table.column_names) - set(OUR_COLUMNS))
    mapped = [theirs for ours, theirs in columns.items() if theirs != ours]
    missing = [c for c in mapped if c in unknown]
    if missing:
        raise DataError(f"{source.name} has no column {', '.join(missing)} (data.columns); its columns: "
                        f"{', '.join(table.column_names)}")
    for i, row in enumerate(table):
        yield f"{source.name} [{source.split} row {i}]", rename(row, columns)


def content_fingerprint(source: Source, cache_dir: Path, digest_of=None) -> str:
    """What the records of `source` are, for the prepared-data key (toolkit.train.prepared_key): the
    BLAKE3 of a file's bytes, or of every file under a directory (with their relative paths); a Hub
    dataset's `datasets` fingerprint (its revision's files), which needs it loaded. `digest_of(path)`:
    a file's BLAKE3 (default: toolkit.checksum.file_digest; a start's is remembered_digests')."""
    from toolkit.checksum import Hasher, file_digest

    digest_of = digest_of or file_digest
    path = Path(source.name)
    if path.is_file():
        return digest_of(path)
    if path.is_dir():
        hasher = Hasher()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            hasher.update(f"{file.relative_to(path).as_posix()}\0{digest_of(file)}\0".encode())
        return hasher.hexdigest()
    if path.suffix == ".jsonl" or path.suffix in BUILDERS or path.is_absolute() or source.name.startswith("."):
        raise DataError(f"data file {path} does not exist")
    return f"datasets:{_load(source, cache_dir)._fingerprint}"


def count_records(source: Source, cache_dir: Path) -> int:
    """How many records `source` holds (a JSONL file: its lines), for a progress bar's total."""
    path = Path(source.name)
    if path.suffix == ".jsonl" or (path.is_file() and path.suffix not in BUILDERS):
        lines, last = 0, b"\n"
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                lines, last = lines + block.count(b"\n"), block[-1:]
        return lines + (last != b"\n")
    return len(_load(source, cache_dir))


def rename(record, columns: dict[str, str]):
    """The record with its columns under our names; columns with no value (a Parquet or CSV row
    lacking a field) are left out, as a JSONL line would."""
    if not isinstance(record, dict):
        return record
    out = {k: v for k, v in record.items() if v is not None and k not in columns.values()}
    for ours, theirs in columns.items():
        if record.get(theirs) is not None:
            out[ours] = record[theirs]
    return out


def _jsonl(path: Path, columns: dict[str, str]) -> Iterator[tuple[str, object]]:
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, ValueError(f"not valid UTF-8 (byte {e.start} of the line)")
                continue
            if not line.strip():
                continue
            try:
                yield where, rename(json.loads(line), columns)
            except ValueError as e:
                yield where, e


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json"))


def _load(source: Source, cache_dir: Path):
    """The `datasets` table of one source and split."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source.name)
    try:
        if _is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if source.split not in loaded:
                    raise DataError(f"{path} has no split {source.split!r} (it has {', '.join(loaded)}): set data.split")
                return loaded[source.split]
            if source.split != "train":
                raise DataError(f"{path} is a single saved split, not {source.split!r}")
            return loaded
        if path.is_file():
            return datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split=source.split,
                                         cache_dir=str(cache_dir))
        if path.is_dir():
            return datasets.load_dataset(str(path), split=source.split, cache_dir=str(cache_dir))
        if path.suffix in BUILDERS or path.is_absolute() or source.name.startswith("."):
            raise DataError(f"data file {path} does not exist")
        return _load_hub(source, cache_dir)
    except DataError:
        raise
    except Exception as e:  # pyarrow's, datasets' and the Hub client's errors: one line naming the source
        raise DataError(f"{source.name} cannot be read by `datasets`: {_first_line(e)}") from None


def _load_hub(source: Source, cache_dir: Path):
    import datasets

    offline = datasets.config.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    try:
        return datasets.load_dataset(source.name, split=source.split, cache_dir=str(cache_dir))
    except Exception as e:
        why = "HF_HUB_OFFLINE is set" if offline else _first_line(e)
        raise DataError(f"{source.name} is not a local file or directory, and as a Hub dataset it cannot be loaded "
                        f"({why}): download it where the Hub can be reached (`datasets` save_to_disk) and give "
                        "that directory, or a local file") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
