"""Gemma 3 as its 4B / 12B / 27B are published (Gemma3ForConditionalGeneration, built here from
transformers' own config classes and saved with save_pretrained, with a tiny vision tower): its
language model converts straight from the multimodal files, exports as a text model
(Gemma3ForCausalLM) that gives the wrapper's text logits, and back into the wrapper with every
other tensor's bytes and the config untouched. Logit parity at TP2 x PP2 against the wrapper:
tests/test_published_parity.py."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_config
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ToolkitError
from toolkit.tinymodels import make_tiny_gemma3_multimodal

PREFIX = "language_model."


@pytest.fixture(scope="module")
def gemma3_wrapper(tmp_path_factory):
    """`fp32` (logit parity) and `bf16` (round trips in the published dtype) wrappers."""
    root = tmp_path_factory.mktemp("gemma3-wrapper")
    return {"fp32": make_tiny_gemma3_multimodal(root / "fp32", "float32", seed=70),
            "bf16": make_tiny_gemma3_multimodal(root / "bf16", "bfloat16", seed=71)}


def tensor_hashes(directory) -> dict[str, str]:
    """sha256 of each tensor's stored bytes, with its dtype and shape."""
    from safetensors import safe_open

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                out[name] = (str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest())
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_wrapper_round_trip_keeps_every_byte_and_the_text_export_loads(gemma3_wrapper, tmp_path, fmt):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    src = gemma3_wrapper["bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, fmt=fmt, progress=False)
    spec = CheckpointMeta.read(out).model_spec
    assert (spec.family, spec.dtype, spec.tied_embeddings) == ("gemma3", "bfloat16", True)

    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    original = tensor_hashes(src)
    assert tensor_hashes(back) == original
    assert any(not n.startswith(PREFIX) for n in original) and any(n.startswith(PREFIX) for n in original)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert type(AutoModelForCausalLM.from_pretrained(back)).__name__ == "Gemma3ForConditionalGeneration"

    text = megatron_to_hf(out, tmp_path / "text", progress=False)
    assert json.loads((text / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert tensor_hashes(text) == {n[len(PREFIX):]: h for n, h in original.items() if n.startswith(PREFIX)}
    assert isinstance(AutoModelForCausalLM.from_pretrained(text), Gemma3ForCausalLM)


def test_text_export_gives_the_wrappers_text_logits(gemma3_wrapper, tmp_path):
    """The reference `verify` uses for a wrapper is its own text-only forward; the exported text
    model reproduces it exactly (no image token among the inputs)."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    src = gemma3_wrapper["fp32"]
    text = megatron_to_hf(hf_to_megatron(src, tmp_path / "m", progress=False), tmp_path / "text", progress=False)
    wrapper, model = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (src, text))
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        assert torch.equal(wrapper(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_published_text_config_takes_dtype_and_tying_from_the_wrapper(gemma3_wrapper, tmp_path):
    """transformers 5 (and the published configs) keep `dtype` at the wrapper's top level only;
    tie_word_embeddings may be there only too."""
    src = tmp_path / "published"
    shutil.copytree(gemma3_wrapper["bf16"], src)
    cfg = json.loads((src / "config.json").read_text())
    assert "dtype" not in cfg["text_config"] and cfg["dtype"] == "bfloat16"
    del cfg["text_config"]["tie_word_embeddings"]
    (src / "config.json").write_text(json.dumps(cfg))
    spec = CheckpointMeta.read(hf_to_megatron(src, tmp_path / "m", progress=False)).model_spec
    assert (spec.dtype, spec.tied_embeddings) == ("bfloat16", True)


def test_export_into_another_wrapper_or_a_text_model_is_refused_in_one_line(gemma3_wrapper, tiny_hf, tmp_path):
    src = gemma3_wrapper["bf16"]
    out = hf_to_megatron(src, tmp_path / "m", progress=False)
    other = tmp_path / "other"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["query_pre_attn_scalar"] = 24
    (other / "config.json").write_text(json.dumps(cfg))
    cases = [(other, "implies 0.2041"), (tiny_hf["gemma3"], "is not a multimodal checkpoint with a language model")]
    for wrapper, line in cases:
        with pytest.raises(ToolkitError, match=r"^[^\n]*" + re.escape(line) + r"[^\n]*$"):
            megatron_to_hf(out, tmp_path / "never", wrapper=wrapper, progress=False)
        assert not (tmp_path / "never").exists()


def test_cli_into_wrapper(gemma3_wrapper, tmp_path, capsys):
    from toolkit.cli import main

    src = gemma3_wrapper["bf16"]
    out = hf_to_megatron(src, tmp_path / "m", progress=False)
    assert main(["convert", "megatron-to-hf", str(out), str(tmp_path / "w"), "--into-wrapper", str(src),
                 "--no-progress"]) == 0
    assert tensor_hashes(tmp_path / "w") == tensor_hashes(src)
    assert main(["convert", "megatron-to-hf", str(out), str(tmp_path / "a"), "--into-wrapper", str(src),
                 "--adapter"]) != 0
    assert "--into-wrapper writes a whole model" in capsys.readouterr().err


def test_wrapper_without_its_language_model_is_refused_in_one_line(gemma3_wrapper, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(gemma3_wrapper["bf16"], src)
    edit_config(src, model_type="gemma3")  # unchanged; the weights renamed instead
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    save_file({n.replace(PREFIX, "text."): t for n, t in tensors.items()}, src / "model.safetensors", metadata={"format": "pt"})
    convert_fails(src, tmp_path / "out", r"^[^\n]*holds no tensor named language_model\.\*[^\n]*$")
