"""The converter's fast write paths must write exactly what the plain ones do.

The `torch` format's rank files are written tensor by tensor into a `torch.save` archive laid out
in advance (toolkit/convert/torch_stream.py); each must be byte for byte the file `torch.save`
writes from the same tensors in memory (torch_format.save_rank_file), and its recorded checksum the
file's own. Shards whose bytes are ranges of the HF files are copied file to file
(toolkit/convert/range_copy.py): the tiny models' ranges are below MIN_RANGE_BYTES, so the tests
force them (`copy_everything`), row-parallel per-row ranges and q/k/v groups included, and force
the fallback where copy_file_range is refused. The `torch_dist` data files are hashed as they are
filled, with no second pass over them, and hold, tensor by tensor, what build_shard builds.
"""

from __future__ import annotations

import errno

import blake3
import pytest
import torch

from toolkit.convert import dist_format, hf_to_megatron, range_copy, torch_format
from toolkit.convert.hf_source import HFCheckpoint
from toolkit.convert.metadata import RELEASE, CheckpointMeta
from toolkit.convert.torch_stream import save_streaming
from toolkit.convert.stages import stage_tensors
from toolkit.families import spec_from_config
from toolkit.layouts import Layout
from toolkit.megatron_settings import megatron_args
from toolkit.splits.kinds import build_shard


@pytest.fixture
def refused_copy_file_range(monkeypatch):
    """copy_file_range answers EXDEV (as between two file systems); returns the calls made."""
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(range_copy, "_copy_file_range", refuse)
    return calls


def _plain_rank_files(src_dir, tp: int, pp: int, ep: int, layer_spec: str, out):
    """Each rank file as torch.save writes it with all of its tensors in memory."""
    src = HFCheckpoint(src_dir)
    family, spec = spec_from_config(src.config)
    layout = Layout(tp, pp, 128, ep)
    args = megatron_args(spec, layout, "torch")
    local_experts = len(layout.local_experts(spec, 0))
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                path = torch_format.rank_file(out, layout, tp_rank, pp_rank, ep_rank)
                model = dict(stage_tensors(src, family, spec, layout, tp_rank, pp_rank, ep_rank=ep_rank))
                torch_format.save_rank_file(path, model, args, layer_spec, len(layout.stage_layers(spec, 0)), local_experts)
                files[path.relative_to(out)] = path.read_bytes()
    return files


@pytest.mark.parametrize("variant, tp, pp, ep, layer_spec", [
    ("llama-tied", 2, 2, 1, "te"),      # tied output copy on the last stage
    ("gemma3", 2, 1, 1, "local"),       # a family's own layer names
    ("qwen3-fp32", 1, 3, 1, "te"),
])
def test_streamed_rank_files_are_byte_identical_to_torch_save(tiny_hf, tmp_path, variant, tp, pp, ep, layer_spec):
    _check_rank_files_against_torch_save(tiny_hf, tmp_path, variant, tp, pp, ep, layer_spec)


@pytest.mark.parametrize("variant, tp", [
    ("llama-odd-vocab", 2),  # vocabulary padding (zero ranges), q/k/v groups split over 2 ranks, row-parallel rows
    ("phi3-1kv", 2),         # fused HF qkv_proj and gate_up_proj; one KV group shared by both ranks
    ("qwen3-fp32", 4),       # 4-byte elements
])
@pytest.mark.parametrize("path", ["copy_everything", "gather_everything"])
def test_copied_rank_files_are_byte_identical_to_torch_save(tiny_hf, tmp_path, request, variant, tp, path):
    copied = request.getfixturevalue(path)
    _check_rank_files_against_torch_save(tiny_hf, tmp_path, variant, tp, 1, 1, "te")
    assert any(r.file is not None for r in copied)
    assert variant != "llama-odd-vocab" or any(r.file is None for r in copied), "the padding rows"


def test_gathered_ranges_in_batches_of_iov_max_and_short_writes_place_every_byte(tmp_path, monkeypatch):
    """Ranges of two files and zeros, gathered a few per pwritev (IOV_MAX made 3), with pwritev
    writing less than asked: the output is the ranges' bytes one after the other."""
    import os
    import random

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(random.Random(0).randbytes(1 << 18))
    b.write_bytes(random.Random(1).randbytes(1 << 16))
    ranges = [range_copy.ByteRange(a, 5000 + 700 * i, 300) for i in range(8)] + [
        range_copy.ByteRange(None, 0, 77), range_copy.ByteRange(b, 65535, 1),
        range_copy.ByteRange(a, 70000, 1 << 16), range_copy.ByteRange(a, 3, 10)]
    expected = b"".join(bytes(r.length) if r.file is None else r.file.read_bytes()[r.offset:r.offset + r.length]
                        for r in ranges)
    pwritev, calls = os.pwritev, []

    def short_pwritev(fd, buffers, offset):
        calls.append(len(buffers))
        return pwritev(fd, buffers[:1], offset) // 2 if len(buffers) > 1 else pwritev(fd, buffers, offset)

    monkeypatch.setattr(range_copy, "_IOV_MAX", 3)
    monkeypatch.setattr(range_copy.os, "pwritev", short_pwritev)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        assert range_copy.copy_ranges(ranges, fd, 11) == len(expected)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == bytes(11) + expected
    assert calls == [3, 3, 2, 1, 1], "8 small ranges of a: 3 + 3 + 2; then b's; the large one copied apart; then a's"
    with pytest.raises(OSError, match="ended 1 bytes early"):
        fd = os.open(tmp_path / "out2", os.O_RDWR | os.O_CREAT)
        try:
            range_copy.copy_ranges([range_copy.ByteRange(b, 65000, 537)], fd, 0)
        finally:
            os.close(fd)


def _range_bytes(ranges, files: dict) -> bytes:
    """The ranges' bytes, read from the files themselves (`files`: their contents, read once)."""
    for r in ranges:
        if r.file is not None and r.file not in files:
            files[r.file] = r.file.read_bytes()
    return b"".join(bytes(r.length) if r.file is None else memoryview(files[r.file])[r.offset:r.offset + r.length]
                    for r in ranges)


def test_every_split_kinds_byte_ranges_are_the_bytes_build_shard_builds(tmp_path, monkeypatch):
    """For every family of the published corpus, each tensor at TP 1 and 2, each rank: where the split
    kind describes the shard as byte ranges of the HF files (copied at real sizes, built at the tiny
    ones), they are byte for byte the tensor build_shard builds. Qwen3-Next's re-laid tensors once
    inherited ColumnSplit's pieces: too few bytes for linear_qkv, the wrong ones for the conv."""
    from tests import published_corpus as corpus
    from toolkit.convert.stages import row_instances
    from toolkit.convert.wrapper import open_hf

    monkeypatch.setattr(range_copy, "MIN_RANGE_BYTES", 1)  # however small the ranges
    described, files = set(), {}
    for name in corpus.distinct_converting():
        src = open_hf(corpus.build_model(name, tmp_path / name))  # as the converter reads it
        family, spec = spec_from_config(src.config)
        for tp in (1, 2):
            geo = Layout(tp, 1, 128).geometry(spec)
            for row in family.rows_for(spec):
                for layer, _, expert, _ in row_instances(row, range(spec.num_layers), range(spec.num_experts),
                                                         spec.moe_layers, spec.linear_layers):
                    names = row.hf_names(layer, expert)
                    for rank in range(tp):
                        ranges = range_copy.shard_ranges(row.split, src, names, tp, rank, geo)
                        if ranges is not None:
                            built = build_shard(row.split, src, names, tp, rank, geo)
                            assert _range_bytes(ranges, files) == _bytes(built), f"{name}: {names} at TP {tp} rank {rank}"
                            described.add(row.split.name)
    assert {"COLUMN", "ROW", "QKV", "GATE_UP", "VOCAB", "REPLICATED"} <= described, described


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_copy_falls_back_where_copy_file_range_is_refused(tiny_hf, tmp_path, copy_everything, refused_copy_file_range):
    _check_rank_files_against_torch_save(tiny_hf, tmp_path, "llama", 2, 2, 1, "te")
    assert len(refused_copy_file_range) == 1, "refused once, then every copy goes through the buffer"
    assert copy_everything


def _check_rank_files_against_torch_save(tiny_hf, tmp_path, variant, tp, pp, ep, layer_spec):
    converted = hf_to_megatron(tiny_hf[variant], tmp_path / "out", tp=tp, pp=pp, layer_spec=layer_spec, progress=False)
    expected = _plain_rank_files(tiny_hf[variant], tp, pp, ep, layer_spec, tmp_path / "plain")
    release = converted / RELEASE
    written = {p.relative_to(release): p.read_bytes() for p in release.rglob(torch_format.RANK_FILE)}
    assert set(written) == set(expected) and len(written) == tp * pp * ep
    for name, data in written.items():
        assert data == expected[name], f"{name} differs from torch.save's file"
    checksums = CheckpointMeta.read(converted).checksums
    for name, data in written.items():
        assert checksums[f"{RELEASE}/{name}"] == "blake3:" + blake3.blake3(data).hexdigest()


def test_streamed_moe_rank_files_are_byte_identical_to_torch_save(tiny_moe, tmp_path):
    converted = hf_to_megatron(tiny_moe["qwen2-moe-bf16"], tmp_path / "out", tp=2, ep=2, progress=False)
    expected = _plain_rank_files(tiny_moe["qwen2-moe-bf16"], 2, 1, 2, "te", tmp_path / "plain")
    release = converted / RELEASE
    for path in release.rglob(torch_format.RANK_FILE):
        assert path.read_bytes() == expected[path.relative_to(release)]


def test_a_tensor_that_does_not_fit_its_record_is_refused(tmp_path):
    placeholders = [torch.empty(4, 3), torch.empty(5)]
    state = {"model": {"a": placeholders[0], "b": placeholders[1]}}
    with pytest.raises(RuntimeError, match="laid out for"):
        save_streaming(state, placeholders, iter([torch.ones(4, 3), torch.ones(6)]), tmp_path / "f.pt")
    with pytest.raises(RuntimeError, match="1 tensors built for 2 records"):
        save_streaming(state, placeholders, iter([torch.ones(4, 3)]), tmp_path / "g.pt")
    digest = save_streaming(state, placeholders, iter([torch.ones(4, 3), torch.arange(5.0)]), tmp_path / "h.pt")
    assert digest == "blake3:" + blake3.blake3((tmp_path / "h.pt").read_bytes()).hexdigest()
    loaded = torch.load(tmp_path / "h.pt", weights_only=True)["model"]
    assert torch.equal(loaded["a"], torch.ones(4, 3)) and torch.equal(loaded["b"], torch.arange(5.0))


def test_torch_dist_data_files_are_hashed_as_written(tiny_hf, tmp_path, monkeypatch):
    from toolkit.convert import metadata

    read_back = []
    file_digest = metadata.file_digest
    monkeypatch.setattr(metadata, "file_digest", lambda path, *a: read_back.append(path.name) or file_digest(path, *a))
    converted = hf_to_megatron(tiny_hf["llama"], tmp_path / "out", tp=2, pp=2, fmt="torch_dist", progress=False)
    assert read_back and not [n for n in read_back if n.endswith(dist_format.DATA_SUFFIX)], read_back
    monkeypatch.setattr(metadata, "file_digest", file_digest)
    assert CheckpointMeta.read(converted).checksums == metadata.checksum_tree(converted), "each recorded checksum is the file's own"


def _stored_tensors_match_build_shard(converted, hf_dir) -> None:
    """Every chunk of a torch_dist checkpoint, read back through DCP, equals the global (TP 1)
    tensor build_shard builds from the HF files: what the converter wrote before byte copies."""
    from toolkit.convert.to_megatron import dist_chunks

    src = HFCheckpoint(hf_dir)
    family, spec = spec_from_config(src.config)
    chunks = dist_chunks(src, family, spec, Layout(1, 1, 128))
    for chunk in chunks:
        stored = dist_format.read_box(converted / RELEASE, chunk.key, chunk.offsets, chunk.shape, chunk.dtype)
        assert torch.equal(stored.reshape(-1).view(torch.uint8), chunk.load().reshape(-1).view(torch.uint8)), chunk.key


@pytest.mark.parametrize("fallback", [False, True], ids=["copy_file_range", "refused"])
def test_copied_torch_dist_holds_what_build_shard_builds(tiny_hf, tmp_path, copy_everything, monkeypatch, fallback):
    """q/k/v groups, gate/up halves, row-parallel rows (whole rows at TP 1), norms, the embedding,
    copied; and the data files byte for byte those the chunks built in memory give."""
    if fallback:
        monkeypatch.setattr(range_copy, "_copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSYS, "")))
    copied = hf_to_megatron(tiny_hf["phi4-mini"], tmp_path / "copied", fmt="torch_dist", progress=False)
    assert copy_everything
    _stored_tensors_match_build_shard(copied, tiny_hf["phi4-mini"])
    monkeypatch.setattr(range_copy, "MIN_RANGE_BYTES", 1 << 62)  # every chunk built in memory
    built = hf_to_megatron(tiny_hf["phi4-mini"], tmp_path / "built", fmt="torch_dist", progress=False)
    data = sorted(p.name for p in (built / RELEASE).glob("*" + dist_format.DATA_SUFFIX))
    assert data and all((copied / RELEASE / n).read_bytes() == (built / RELEASE / n).read_bytes() for n in data)
    assert CheckpointMeta.read(copied).checksums == metadata_checksums(copied)


def metadata_checksums(converted):
    from toolkit.convert.metadata import checksum_tree

    return checksum_tree(converted)


def test_a_failure_in_a_dcp_writer_thread_fails_the_conversion(tiny_hf, tmp_path, copy_everything, monkeypatch):
    """DCP writes each data file on a thread and only prints what the thread raises: the
    converter must raise it, and leave nothing behind."""
    calls = []

    def fail_third(ranges, *args):
        calls.append(ranges)
        if len(calls) == 3:
            raise OSError(errno.EIO, "the disk went away")
        return range_copy.copy_ranges(ranges, *args)

    monkeypatch.setattr("toolkit.convert.torch_stream.copy_ranges", fail_third)
    with pytest.raises(OSError, match="the disk went away"):
        hf_to_megatron(tiny_hf["llama"], tmp_path / "out", fmt="torch_dist", progress=False)
    assert not list(tmp_path.iterdir())
