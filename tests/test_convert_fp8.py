"""Checkpoints with FP8 weights and block scales, as DeepSeek-V3 / R1 and Kimi-K2 are published
(toolkit/convert/fp8.py): converted to bf16 while reading, as DeepSeek's weight_dequant does.

The tiny checkpoint really stores float8_e4m3fn weights and float32 `weight_scale_inv` per 16 x 16 block
(toolkit/tinymodels.py quantize_fp8), with blocks cut at the edges (40 and 24 rows); the test's own
dequantization, block by block, is the reference."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_roundtrip import load_all
from tests.conversion_memory import ResidentReads, assert_bounded_by_a_tensor
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.fp8 import dequantize
from toolkit.tinymodels import make_tiny_model, quantize_fp8

BLOCK = (16, 16)


def reference_dequantization(path) -> dict[str, torch.Tensor]:
    """Every tensor of the file as bf16: a quantized weight block by block, float32(x) * s cast to bf16."""
    out = {}
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        for name in names - {n for n in names if n.endswith("_scale_inv")}:
            x = f.get_tensor(name)
            if name + "_scale_inv" not in names:
                out[name] = x
                continue
            s, y = f.get_tensor(name + "_scale_inv"), torch.empty(x.shape, dtype=torch.bfloat16)
            for i in range(math.ceil(x.shape[0] / BLOCK[0])):
                for j in range(math.ceil(x.shape[1] / BLOCK[1])):
                    block = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
                    y[block] = (x[block].float() * s[i, j]).bfloat16()
            out[name] = y
    return out


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """As DeepSeek publishes it, whatever the installed transformers: the router in bf16 and the expert bias in
    float32 (transformers >= 5.24 would save the router in float32: tests/test_float32_routers.py)."""
    return quantize_fp8(make_tiny_model("deepseek-v3", tmp_path_factory.mktemp("fp8") / "hf", dtype="bfloat16", seed=7,
                                        fp32_modules=("e_score_correction_bias",)), BLOCK)


def test_the_tiny_checkpoint_is_fp8_as_published(fp8_model):
    with safe_open(fp8_model / "model.safetensors", framework="pt") as f:
        kv = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
        scale = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
    assert (kv.dtype, tuple(kv.shape), scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (40, 64),
                                                                            torch.float32, (3, 4))
    assert router.dtype == torch.bfloat16
    assert json.loads((fp8_model / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_fp8_weights_convert_to_the_reference_bf16_at_tp2_pp2_ep2(fp8_model, tmp_path, monkeypatch, fmt):
    """Every tensor of the round trip equals the reference dequantization bit for bit; the export is a
    bf16 checkpoint without scales or quantization_config, which transformers loads. Memory stays bounded
    by a tensor: the FP8 weights and scales read, and the bf16 tensors dequantized from them, are alive a
    tensor per rank file being written at a time (tests/conversion_memory.py)."""
    from transformers import AutoModelForCausalLM

    resident = ResidentReads.following(monkeypatch)
    out = hf_to_megatron(fp8_model, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, layer_spec="local", progress=False)
    assert_bounded_by_a_tensor(resident)
    monkeypatch.undo()
    back = megatron_to_hf(out, tmp_path / "back", progress=False)
    expected, restored = reference_dequantization(fp8_model / "model.safetensors"), load_all(back)
    assert set(restored) == set(expected)
    assert all(torch.equal(restored[k], expected[k]) for k in expected)
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(back)


def test_dequantizing_a_slice_reads_its_blocks_scales():
    """What a TP split reads: rows 40..100 (inside a block row) or 100..300 (across three) and columns 130..300
    of a 300 x 300 weight in 128 x 128 blocks."""
    torch.manual_seed(0)
    x = (torch.randn(300, 300) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3) + 0.5
    whole = dequantize(x, s, (128, 128))
    part = dequantize(x[40:100, 130:300], s[0:1, 1:3], (128, 128), 40, 130)
    assert torch.equal(part, whole[40:100, 130:300])
    assert torch.equal(dequantize(x[100:300, 130:300], s[0:3, 1:3], (128, 128), 100, 130), whole[100:300, 130:300])
    assert torch.equal(whole[127, 128], (x[127, 128].float() * s[0, 1]).bfloat16())
    assert torch.equal(whole[299, 299], (x[299, 299].float() * s[2, 2]).bfloat16())


def test_what_is_not_dequantized_exactly_is_refused_in_one_line(fp8_model, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in fp8_model.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    quantization = json.loads((src / "config.json").read_text())["quantization_config"]
    for changes, line in (({"fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported"),
                          ({"weight_block_size": [16]}, "weight_block_size=\\[16\\]: expected two positive integers")):
        edit_config(src, quantization_config={**quantization, **changes})
        convert_fails(src, tmp_path / "out", line, layer_spec="local")
    edit_config(src, quantization_config=quantization)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    edit_tensors(src, lambda t: t.update({name: t[name][:, :1].contiguous()}))
    convert_fails(src, tmp_path / "out", "is not an FP8 weight with float32 scales per 16 x 16 block", layer_spec="local")
    edit_tensors(src, lambda t: t.pop(name))
    convert_fails(src, tmp_path / "out", "is FP8 without its 'model.layers.1.self_attn.o_proj.weight_scale_inv'",
                  layer_spec="local")
