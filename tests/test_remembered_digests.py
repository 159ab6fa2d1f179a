"""A data file's digest is remembered by its stat (toolkit/train/remembered_digests.py): a start reads
an unchanged file no more, and any change to it (another size, content of the same size with its
modification time put back, a replacing file) is hashed again. The reference is BLAKE3 of the bytes."""

from __future__ import annotations

import os
import time

import blake3
import pytest

from toolkit.train import remembered_digests
from toolkit.train.remembered_digests import remembered_digest

OLD = time.time() - 3600  # a modification time far before the hashing (not racy)


def reference(path) -> str:
    return "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()


@pytest.fixture
def counted(monkeypatch):
    """The files remembered_digest reads."""
    read = []
    real = remembered_digests.file_digest
    monkeypatch.setattr(remembered_digests, "file_digest", lambda p: read.append(p.name) or real(p))
    return read


def data_file(tmp_path, text: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    os.utime(path, (OLD, OLD))
    return path


def test_an_unchanged_file_is_read_once(tmp_path, counted):
    path = data_file(tmp_path, '{"text": "a"}\n' * 100)
    first = remembered_digest(path, tmp_path / "memo")
    assert remembered_digest(path, tmp_path / "memo") == first == reference(path)
    assert counted == ["data.jsonl"]


def test_every_change_is_hashed_again(tmp_path, counted):
    path = data_file(tmp_path, '{"text": "a"}\n')
    memo = tmp_path / "memo"
    remembered_digest(path, memo)
    path.write_text('{"text": "b"}\n')  # the same size, and its modification time put back as it was
    os.utime(path, (OLD, OLD))
    assert remembered_digest(path, memo) == reference(path)
    path.write_text('{"text": "bb"}\n')  # another size
    os.utime(path, (OLD, OLD))
    assert remembered_digest(path, memo) == reference(path)
    other = data_file(tmp_path, '{"text": "c"}\n', "other.jsonl")  # a replacing file: another inode
    os.replace(other, path)
    assert remembered_digest(path, memo) == reference(path)
    assert counted == ["data.jsonl"] * 4


def test_a_recently_written_file_is_not_remembered(tmp_path, counted):
    """Racy git's rule: written less than RACY_S before its hashing, the next start hashes it again."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n')
    for _ in range(2):
        assert remembered_digest(path, tmp_path / "memo") == reference(path)
    assert counted == ["data.jsonl"] * 2


def test_an_unreadable_or_unwritable_memo_only_costs_a_read(tmp_path, counted):
    path = data_file(tmp_path, '{"text": "a"}\n')
    memo = tmp_path / "memo"
    remembered_digest(path, memo)
    for entry in memo.iterdir():
        entry.write_text("{not json")
    assert remembered_digest(path, memo) == reference(path)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the memo's directory would be")
    assert remembered_digest(path, blocked) == reference(path)
    assert counted == ["data.jsonl"] * 3


def test_guard_without_the_change_time_a_same_size_edit_goes_unseen(tmp_path, monkeypatch):
    path = data_file(tmp_path, '{"text": "a"}\n')
    real = remembered_digests.stamp
    monkeypatch.setattr(remembered_digests, "stamp", lambda p: real(p)[:4])
    remembered_digest(path, tmp_path / "memo")
    path.write_text('{"text": "b"}\n')
    os.utime(path, (OLD, OLD))
    assert remembered_digest(path, tmp_path / "memo") != reference(path)
