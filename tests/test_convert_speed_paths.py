"""The converter's fast write paths must write exactly what the plain ones do.

The `torch` format's rank files are written tensor by tensor into a `torch.save` archive laid out
in advance (toolkit/convert/torch_stream.py); each must be byte for byte the file `torch.save`
writes from the same tensors in memory (torch_format.save_rank_file), and its recorded sha256 the
file's own. The `torch_dist` data files are hashed as DCP writes them, not read back.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from toolkit.convert import hf_to_megatron, torch_format
from toolkit.convert.hf_source import HFCheckpoint
from toolkit.convert.metadata import RELEASE, CheckpointMeta
from toolkit.convert.torch_stream import save_streaming
from toolkit.convert.stages import stage_tensors
from toolkit.families import spec_from_config
from toolkit.layouts import Layout
from toolkit.megatron_settings import megatron_args


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
    converted = hf_to_megatron(tiny_hf[variant], tmp_path / "out", tp=tp, pp=pp, layer_spec=layer_spec, progress=False)
    expected = _plain_rank_files(tiny_hf[variant], tp, pp, ep, layer_spec, tmp_path / "plain")
    release = converted / RELEASE
    written = {p.relative_to(release): p.read_bytes() for p in release.rglob(torch_format.RANK_FILE)}
    assert set(written) == set(expected) and len(written) == tp * pp * ep
    for name, data in written.items():
        assert data == expected[name], f"{name} differs from torch.save's file"
    checksums = CheckpointMeta.read(converted).checksums
    for name, data in written.items():
        assert checksums[f"{RELEASE}/{name}"] == hashlib.sha256(data).hexdigest()


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
    assert digest == hashlib.sha256((tmp_path / "h.pt").read_bytes()).hexdigest()
    loaded = torch.load(tmp_path / "h.pt", weights_only=True)["model"]
    assert torch.equal(loaded["a"], torch.ones(4, 3)) and torch.equal(loaded["b"], torch.arange(5.0))


def test_torch_dist_data_files_are_hashed_as_written(tiny_hf, tmp_path, monkeypatch):
    from toolkit.convert import dist_format, metadata

    read_back = []
    sha256 = metadata.sha256
    monkeypatch.setattr(metadata, "sha256", lambda path, *a: read_back.append(path.name) or sha256(path, *a))
    converted = hf_to_megatron(tiny_hf["llama"], tmp_path / "out", tp=2, pp=2, fmt="torch_dist", progress=False)
    assert read_back and not [n for n in read_back if n.endswith(dist_format.DATA_SUFFIX)], read_back
    monkeypatch.setattr(metadata, "sha256", sha256)
    assert CheckpointMeta.read(converted).checksums == metadata.checksum_tree(converted), "each recorded sha256 is the file's own"
