"""Issue 24: a checkpoint is opened and validated once, and the object passed along. An export
reads each of the checkpoint's small files once (`toolkit_checkpoint.json`, `hf/config.json`, the
tracker), and a torch_dist checkpoint's DCP index (`.metadata`, which names every chunk of every
tensor) once for its checksum and once as the index, not again for every tensor it reads.

The count is of real opens on a real converted checkpoint: Python's `open` (which pathlib and
DCP's file system reader call) and `os.open` (the checksum's, which maps the file) wrapped for the
export alone."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest

from toolkit.convert import hf_to_megatron, megatron_to_hf


def counting_opens(monkeypatch) -> Counter:
    opens = Counter()

    def counting(real):
        def counted(file, *args, **kwargs):
            if isinstance(file, (str, Path)):
                opens[Path(file).resolve()] += 1
            return real(file, *args, **kwargs)
        return counted

    counted_open = counting(io.open)
    monkeypatch.setattr(io, "open", counted_open)
    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(os, "open", counting(os.open))
    return opens


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_an_export_reads_the_checkpoints_metadata_once(tiny_hf, tmp_path, monkeypatch, fmt):
    converted = Path(hf_to_megatron(tiny_hf["llama"], tmp_path / "mc", fmt=fmt, progress=False,
                                    **({"tp": 2, "pp": 2} if fmt == "torch" else {}))).resolve()
    with monkeypatch.context() as patch:
        opens = counting_opens(patch)
        megatron_to_hf(converted, tmp_path / "hf", progress=False)
    once = {name: opens[converted / name] for name in ("toolkit_checkpoint.json", "hf/config.json",
                                                       "latest_checkpointed_iteration.txt")}
    assert once == dict.fromkeys(once, 1), once
    if fmt == "torch_dist":  # its checksum, then the index every tensor is read through
        assert opens[converted / "release" / ".metadata"] == 2, opens[converted / "release" / ".metadata"]
    else:  # each rank file: its checksum, then its tensors
        rank_files = sorted((converted / "release").glob("mp_rank_*/model_optim_rng.pt"))
        assert len(rank_files) == 4 and all(opens[p] <= 2 for p in rank_files), {p: opens[p] for p in rank_files}
