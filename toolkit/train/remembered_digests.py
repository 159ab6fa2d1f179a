"""A data file's BLAKE3, remembered by what `stat` says of the file, so that a start does not read a
data set of gigabytes again only to find its prepared cache (toolkit.train.prepared_key keys the
cache on the records' content). At a million conversations the JSONL file is 4.3 GB: hashed on
every start, that read was most of a rank's time to its first batch (docs/benchmarks.md).

A remembered digest is used while the file's device, inode, size, modification and change times
(nanoseconds) are the ones it was hashed with. Writing to a file changes its modification and
change times, and the change time cannot be set back (`touch -d` and `os.utime` set it to now);
a file replaced by another has another inode. As git does for its index ("racy git"), a digest is
remembered only for a file last modified at least RACY_S before it was hashed, and whose `stat`
did not change while it was hashed: a write in the same tick of the file system's clock as the
hashing could otherwise go unseen. A memo that cannot be read or written is ignored: the file is
hashed, as before.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from toolkit.checksum import Hasher, file_digest, is_recorded_digest
from toolkit.errors import ToolkitError

RACY_S = 2.0  # a file modified this recently before its hashing is hashed again next time


def stamp(path: Path) -> list[int]:
    """What identifies this version of the file, without reading it."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def remembered_digest(path: Path, memo_dir: Path) -> str:
    """file_digest(path), read from `memo_dir` when the file has not changed since it was hashed."""
    from toolkit.atomic import write_file

    path = Path(path).resolve()
    hasher = Hasher()
    hasher.update(str(path).encode())
    memo = Path(memo_dir) / f"{hasher.hexdigest().split(':', 1)[1][:32]}.json"
    before = stamp(path)
    try:
        saved = json.loads(memo.read_text())
        if saved["path"] == str(path) and saved["stamp"] == before and is_recorded_digest(saved["digest"]):
            return saved["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    started = time.time_ns()
    digest = file_digest(path)
    if stamp(path) == before and before[3] < started - RACY_S * 1e9:
        try:
            write_file(memo, json.dumps({"path": str(path), "stamp": before, "digest": digest}))
        except (ToolkitError, OSError):
            pass  # a read-only or full cache directory: hashed again next time
    return digest
