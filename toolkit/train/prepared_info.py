"""`toolkit data inspect DIR`: what prepared data holds, from its meta.json (and, with verify, its
arrays' BLAKE3 digests). DIR is one prepared directory, or a directory holding them
(data.cache_dir, or its prepared/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from toolkit.train.data_sources import DataError
from toolkit.train.prepare_data import PREPARED
from toolkit.train.prepared_store import META, SampleStore


def prepared_dirs(path: Path) -> list[Path]:
    path = Path(path)
    if (path / META).is_file():
        return [path]
    root = path / PREPARED if (path / PREPARED).is_dir() else path
    if not root.is_dir():
        raise DataError(f"{path} is not a directory")
    found = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not found:
        raise DataError(f"{path} holds no prepared data (a directory with {META}, or data.cache_dir's {PREPARED}/)")
    return found


def describe(path: Path, verify: bool = False) -> list[dict]:
    """Each prepared directory under `path`: its key fields, counts and sizes; a damaged one is a
    DamagedStore naming the file."""
    out = []
    for directory in prepared_dirs(path):
        store = SampleStore.open(directory, verify=verify)
        meta = store.meta
        lengths = store.lengths
        pairs = meta["method"] == "dpo"
        out.append({
            "directory": str(directory), "source": meta["fields"]["source"], "split": meta["fields"]["split"],
            "method": meta["method"], "rows": len(store) // 2 if pairs else len(store), "sequences": len(store),
            "tokens": int(meta["stored_tokens"]), "trained_tokens": int(np.asarray(store.targets, dtype=np.int64).sum()),
            "length": {"min": int(lengths.min()) if len(lengths) else 0, "mean": float(lengths.mean()) if len(lengths) else 0.0,
                       "max": int(lengths.max()) if len(lengths) else 0},
            "bytes": sum(a["bytes"] for a in meta["arrays"].values()),
            "checked": "BLAKE3 of every array" if verify else "sizes (--verify: BLAKE3 of every array)",
            "key": meta["fields"], "stats": meta["stats"], "prepare_seconds": meta.get("prepare_seconds"),
        })
    return out


def lines(described: list[dict]) -> list[str]:
    from toolkit.atomic import human_bytes

    out = []
    for info in described:
        unit = "pairs" if info["method"] == "dpo" else "samples"
        options = info["key"]["options"]
        out += [
            f"{info['directory']}",
            f"  source     {info['source']} [{info['split']}] ({info['key']['content']})",
            f"  method     {info['method']}: {info['rows']:,} {unit}, {info['tokens']:,} tokens "
            f"({info['trained_tokens']:,} trained), {human_bytes(info['bytes'])} on disk",
            f"  lengths    min {info['length']['min']}, mean {info['length']['mean']:.1f}, max {info['length']['max']}",
            f"  options    max_tokens {options['max_tokens']} (seq_len + 1), overlong={options['overlong']}, "
            f"truncation={options['truncation']}, malformed={options['malformed']}",
            f"  tokenizer  {info['key']['tokenizer']}",
            "  read       " + ", ".join(f"{k} {v}" for k, v in info["stats"].items()
                                       if k not in ("unk_example", "mixture", "packed_rows")),
            f"  checked    {info['checked']}",
        ]
    return out
