"""HF -> megatron -> HF must give back exactly the same files' contents.

A round trip only proves self-consistency (a wrong interleave undone on export still passes);
the logit parity tests in test_convert_parity.py prove the layout itself.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta

LAYOUTS = list(itertools.product((1, 2, 4), (1, 2, 3)))


def load_all(directory):
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize(
    "variant",
    ["llama", "llama-tied", "llama-odd-vocab", "qwen2", "mistral", "llama-fp32", "qwen3", "qwen3-tied", "qwen3-fp32", "phi3",
     "phi4-mini", "phi4-mini-fp32", "gemma3", "gemma3-fp32", "olmo2", "olmo2-fp32", "olmo3", "smollm3"],
)
def test_round_trip_is_bit_exact_for_every_layout(tiny_hf, tmp_path, variant, fmt):
    src = tiny_hf[variant]
    original = load_all(src)
    for tp, pp in LAYOUTS:
        mcore = hf_to_megatron(src, tmp_path / f"m{tp}{pp}", tp=tp, pp=pp, fmt=fmt, progress=False)
        back = megatron_to_hf(mcore, tmp_path / f"h{tp}{pp}", progress=False)
        restored = load_all(back)
        assert set(restored) == set(original), f"TP={tp} PP={pp}: tensor names differ"
        for name, tensor in original.items():
            assert restored[name].dtype == tensor.dtype, (tp, pp, name)
            assert torch.equal(restored[name], tensor), f"TP={tp} PP={pp}: {name} differs"
        assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            assert (back / f).read_bytes() == (src / f).read_bytes()


def test_vocab_is_padded_with_zero_rows_and_true_size_recorded(tiny_hf, tmp_path):
    out = hf_to_megatron(tiny_hf["llama-odd-vocab"], tmp_path / "m", tp=2, fmt="torch", progress=False)
    meta = CheckpointMeta.read(out)
    assert (meta.vocab_size, meta.padded_vocab_size) == (250, 256)  # 128 * TP=2 divides 256
    from toolkit.convert.torch_format import load_trusted_types

    last_rank = load_trusted_types(out / "release" / "mp_rank_01" / "model_optim_rng.pt")["model"]
    emb = last_rank["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 128 and torch.count_nonzero(emb[250 - 128 :]) == 0


def test_vocab_divisor_one_means_no_padding(tiny_hf, tmp_path):
    out = hf_to_megatron(tiny_hf["llama-odd-vocab"], tmp_path / "m", vocab_divisor=1, progress=False)
    assert CheckpointMeta.read(out).padded_vocab_size == 250


def test_large_export_is_sharded_with_an_index(tiny_hf, tmp_path):
    mcore = hf_to_megatron(tiny_hf["llama"], tmp_path / "m", tp=2, pp=2, progress=False)
    back = megatron_to_hf(mcore, tmp_path / "h", max_shard_bytes=200_000, progress=False)
    files = sorted(p.name for p in back.glob("*.safetensors"))
    assert len(files) > 1 and (back / "model.safetensors.index.json").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(back)
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf["llama"])
    for (n, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), n


def test_te_and_local_names(tiny_hf, tmp_path):
    from toolkit.convert.torch_format import load_trusted_types

    te = hf_to_megatron(tiny_hf["llama"], tmp_path / "te", progress=False)
    local = hf_to_megatron(tiny_hf["llama"], tmp_path / "local", layer_spec="local", progress=False)
    te_keys = set(load_trusted_types(te / "release/mp_rank_00/model_optim_rng.pt")["model"])
    local_keys = set(load_trusted_types(local / "release/mp_rank_00/model_optim_rng.pt")["model"])
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_keys
    assert "decoder.layers.0.input_layernorm.weight" in local_keys
    assert len(te_keys) == len(local_keys)


def test_megatron_lm_args_are_stored(tiny_hf, tmp_path):
    from toolkit.convert.torch_format import load_trusted_types

    out = hf_to_megatron(tiny_hf["llama"], tmp_path / "m", tp=2, pp=3, progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    state = load_trusted_types(out / "release/mp_rank_01_002/model_optim_rng.pt")
    args = state["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 3)
    assert (args.num_layers, args.padded_vocab_size, args.make_vocab_size_divisible_by) == (6, 256, 128)
    assert state["checkpoint_version"] == 3.0
    # PP stage 2 holds global layers 4-5 renumbered from 0
    assert "decoder.layers.1.mlp.linear_fc2.weight" in state["model"]
    assert "decoder.layers.2.mlp.linear_fc2.weight" not in state["model"]


def test_megatron_lm_checkpoint_without_our_metadata_exports_with_hf_config(tiny_hf, tmp_path):
    """A per-rank checkpoint as Megatron-LM training writes it (no toolkit metadata, an
    iteration directory) exports given the architecture's HF config."""
    import shutil

    from toolkit.errors import ToolkitError

    src = tiny_hf["qwen2"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=3, progress=False)
    (out / "toolkit_checkpoint.json").unlink()
    shutil.rmtree(out / "hf")
    (out / "release").rename(out / "iter_0000120")
    (out / "latest_checkpointed_iteration.txt").write_text("120")
    with pytest.raises(ToolkitError, match="--hf-config"):
        megatron_to_hf(out, tmp_path / "h0", progress=False)
    back = megatron_to_hf(out, tmp_path / "h", hf_config=src / "config.json", progress=False)
    original, restored = load_all(src), load_all(back)
    assert set(original) == set(restored) and all(torch.equal(original[k], restored[k]) for k in original)


def test_fp32_training_weights_export_as_the_bf16_source_dtype_rounded(tiny_hf, tmp_path):
    """Training checkpoints hold fp32 master weights; export casts them to the source's bf16,
    value for value as torch rounds them (not truncated, not left in fp32)."""
    import json

    from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
    from toolkit.checksum import file_digest
    from toolkit.convert.metadata import META_FILE
    from toolkit.convert.torch_format import load_trusted_types

    out = hf_to_megatron(tiny_hf["llama"], tmp_path / "m", tp=2, fmt="torch", progress=False)
    meta = json.loads((out / META_FILE).read_text())
    generator = torch.Generator().manual_seed(0)
    for rank_file in sorted(out.glob("release/mp_rank_*/model_optim_rng.pt")):
        state = load_trusted_types(rank_file, mmap=False)
        for key, t in state["model"].items():
            if torch.is_tensor(t) and t.is_floating_point():  # fp32, with bits bf16 cannot hold
                state["model"][key] = t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=generator))
        torch.save(state, rank_file)
        meta["checksums"][str(rank_file.relative_to(out))] = file_digest(rank_file)
    (out / META_FILE).write_text(json.dumps(meta))

    fp32 = dict(MegatronCheckpoint.open(out).hf_tensors())
    exported = load_all(megatron_to_hf(out, tmp_path / "hf", progress=False))
    assert set(exported) == set(fp32)
    for name, tensor in exported.items():
        assert fp32[name].dtype == torch.float32, name
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
