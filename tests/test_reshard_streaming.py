"""`ckpt reshard`'s model/ rewrite (toolkit.convert.reslice): each shard of the new layout copied
from the stored shards, one tensor resident at a time. Checked against a direct conversion from HF
at the new layout, an independent path (toolkit.splits building each shard from the HF tensors)."""

from __future__ import annotations

import weakref

import pytest

from toolkit.convert import hf_to_megatron, reslice, torch_format
from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
from toolkit.convert.metadata import RELEASE, CheckpointMeta
from toolkit.layouts import Layout
from toolkit.train.reshard import reshard_model


@pytest.mark.parametrize("variant, old, new", [
    ("llama-odd-vocab", (2, 2, 1), (4, 1, 1)),  # the padded vocabulary grows (256 -> 512 rows)
    ("phi4-mini", (1, 2, 1), (4, 1, 1)),        # HF-fused QKV and gate/up, tied output copy dropped, odd FFN
    ("qwen3-1kv", (1, 1, 1), (2, 2, 1)),        # one KV head under TP 2, a tied output copy made
    ("gemma3", (2, 1, 1), (1, 2, 1)),
    ("qwen2-moe", (2, 1, 2), (1, 2, 3)),        # experts over another EP, a shared expert, q/k/v biases
    ("qwen3-next", (2, 1, 1), (1, 2, 2)),       # gated delta net parts and the output-gated QKV, re-split
])
def test_resharded_rank_files_equal_a_direct_conversion_one_tensor_resident_at_a_time(tiny_hf, tiny_moe, tmp_path,
                                                                                      monkeypatch, variant, old, new):
    if variant == "qwen3-next":  # before: NotImplementedError, its re-laid tensors were not resliced
        from toolkit.tinymodels import make_tiny_model

        hf = make_tiny_model(variant, tmp_path / "hf", dtype="bfloat16", seed=7)
    else:
        hf = {**tiny_hf, **tiny_moe}[variant]
    stored = hf_to_megatron(hf, tmp_path / "old", tp=old[0], pp=old[1], ep=old[2], layer_spec="local", progress=False)
    direct = hf_to_megatron(hf, tmp_path / "direct", tp=new[0], pp=new[1], ep=new[2], layer_spec="local", progress=False)

    built, held = [], []
    real = reslice.reslice

    def tracked(*args):
        held.extend(i for i, ref in enumerate(built) if ref() is not None)
        shard = real(*args)
        built.append(weakref.ref(shard))
        return shard

    monkeypatch.setattr(reslice, "reslice", tracked)
    source = MegatronCheckpoint.open(stored)
    reshard_model(source, tmp_path / "resharded", Layout(*new[:2], source.layout.vocab_divisor, new[2]))
    assert built, "nothing was resliced"
    assert not held, f"shards {sorted(set(held))[:5]} were still held when the next was built"

    files = sorted(p.relative_to(direct) for p in (direct / RELEASE).rglob(torch_format.RANK_FILE))
    assert files == sorted(p.relative_to(tmp_path / "resharded")
                           for p in (tmp_path / "resharded" / RELEASE).rglob(torch_format.RANK_FILE))
    for name in files:
        assert (tmp_path / "resharded" / name).read_bytes() == (direct / name).read_bytes(), name
    assert CheckpointMeta.read(tmp_path / "resharded").checksums == CheckpointMeta.read(direct).checksums
