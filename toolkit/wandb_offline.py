"""Read W&B offline runs back without a network: for tests, and for users on air-gapped clusters.

`WANDB_MODE=offline` writes RUN_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb, a LevelDB-log
framed stream of wandb's own protobuf records (wandb.proto.wandb_internal_pb2.Record). In wandb
0.31 that file is the only copy of the metrics (no wandb-summary.json or config.yaml offline).

A requeued job starts the trainer again with the same run id and resume="allow", and wandb writes
one offline directory per start, all with that id (offline, wandb cannot ask the server, so each
directory's run record says resumed=False and starting_step=0). `read_runs` merges them by id in
start-time order; when a start re-logs steps an earlier one already logged (a crash after the last
checkpoint), the later copy wins, as in the trainer's metrics.jsonl. `wandb sync DIR1 DIR2 ...`
uploads directories of one run id into that one run, sequentially in order of start time
(documented in `wandb sync --help`, 0.31.0); that upload needs a W&B server and is not tested here.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ToolkitError

TESTED_WANDB_VERSION = "0.31.0"  # the record format below was read and tested with this release

# LevelDB log framing (leveldb/doc/log_format.md), as used by wandb's transaction log.
_BLOCK, _HEADER = 32768, 7  # block size; record header = crc32c u32, length u16, type u8
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MAGIC = (b":W&B", 0xBEE1, 0)  # file header: ident, magic, version


class WandbReadError(ToolkitError):
    """An offline W&B directory is missing or not in the format this reader knows."""


@dataclass
class Segment:
    """One offline directory: one start of the trainer."""

    path: Path
    run_id: str = ""
    project: str = ""
    start_time: float = 0.0
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None  # None: the process died without finishing the run


@dataclass
class OfflineRun:
    run_id: str
    project: str
    config: dict
    history: list[dict]  # merged over segments, one row per step
    summary: dict
    segments: list[Segment]

    @property
    def steps(self) -> list[int]:
        return [row["_step"] for row in self.history]

    def metric(self, name: str) -> list:
        return [row[name] for row in self.history if name in row]


def _check_version() -> None:
    try:
        from wandb import __version__ as version
    except ImportError:
        return
    if version != TESTED_WANDB_VERSION:
        warnings.warn(f"toolkit.wandb_offline was tested with wandb {TESTED_WANDB_VERSION}; this is {version}",
                      stacklevel=3)


def iter_records(path: Path):
    """Raw record payloads of a .wandb file; stops quietly at a torn tail (a run killed mid-write)."""
    data = Path(path).read_bytes()
    if len(data) < 7 or struct.unpack("<4sHB", data[:7]) != _MAGIC:
        raise WandbReadError(f"{path} is not a W&B transaction log")
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero fill after the last record
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        if len(chunk) < length:
            return
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _items(items) -> dict:
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_segment(path: str | Path) -> Segment:
    """One run-<id>.wandb file (or the offline-run directory holding it)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if not files:
            raise WandbReadError(f"no run-*.wandb in {path}")
        path = files[0]
    seg = Segment(path=path)
    for raw in iter_records(path):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except DecodeError:
            break  # torn tail
        kind = record.WhichOneof("record_type")
        if kind == "history":
            seg.history.append(_items(record.history.item))
        elif kind == "summary":
            seg.summary.update(_items(record.summary.update))
            for item in record.summary.remove:
                seg.summary.pop(item.key or "/".join(item.nested_key), None)
        elif kind == "run":
            seg.run_id, seg.project = record.run.run_id, record.run.project
            seg.start_time = record.run.start_time.seconds + record.run.start_time.nanos / 1e9
            seg.config.update(_items(record.run.config.update))
        elif kind == "config":
            seg.config.update(_items(record.config.update))
        elif kind == "exit":
            seg.exit_code = record.exit.exit_code
    seg.config.pop("_wandb", None)
    if not seg.run_id:  # killed before wandb-core wrote the run record: the file name carries the id
        seg.run_id = path.stem.removeprefix("run-")
    return seg


def find_segments(root: str | Path) -> list[Path]:
    """Every offline run file below `root` (a run directory, its wandb/ folder, or one run)."""
    root = Path(root)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise WandbReadError(f"{root} does not exist")
    return sorted(root.rglob("run-*.wandb"))


def merge(segments: list[Segment]) -> OfflineRun:
    """Segments of one run id -> one run; a later start's steps replace an earlier start's copies."""
    ordered = sorted(segments, key=lambda s: (s.start_time, s.path.parent.name))
    history: list[dict] = []
    for seg in ordered:
        rows = [row for row in seg.history if "_step" in row]
        if rows:
            first = min(row["_step"] for row in rows)
            history = [row for row in history if row["_step"] < first]
        history.extend(rows)
    config: dict = {}
    for seg in ordered:
        config.update(seg.config)
    last = ordered[-1]
    return OfflineRun(last.run_id, last.project, config, history, dict(last.summary), ordered)


def read_runs(root: str | Path) -> dict[str, OfflineRun]:
    """All offline runs below `root`, merged by run id."""
    _check_version()
    by_id: dict[str, list[Segment]] = {}
    for path in find_segments(root):
        seg = read_segment(path)
        by_id.setdefault(seg.run_id, []).append(seg)
    if not by_id:
        raise WandbReadError(f"no offline W&B run (run-*.wandb) below {root}")
    return {run_id: merge(segs) for run_id, segs in by_id.items()}


def summarize(run: OfflineRun) -> dict:
    steps = run.steps
    metrics = sorted({k for row in run.history for k in row if not k.startswith("_")})
    last = run.history[-1] if run.history else {}
    return {
        "run_id": run.run_id,
        "project": run.project,
        "segments": [{"dir": str(s.path.parent), "steps": [r["_step"] for r in s.history if "_step" in r],
                      "exit_code": s.exit_code} for s in run.segments],
        "steps": {"first": steps[0] if steps else None, "last": steps[-1] if steps else None, "rows": len(steps),
                  "each_once": len(steps) == len(set(steps)) and steps == sorted(steps)},
        "metrics": metrics,
        "last": {k: v for k, v in last.items() if not k.startswith("_")},
        "config_keys": sorted(run.config),
    }
