"""Kimi-K2.5 (kimi_k25 wrapper, Kimi_K25ForConditionalGeneration): DeepSeek-V3's language model (its text_config's
model_type kimi_k2, read through DeepseekV3Config as Kimi_K25Config does) under `language_model.model.*` and
`language_model.lm_head` (toolkit/convert/wrapper.py), beside the vision tower and projector.

HF is the reference: the wrapper itself on text, against megatron-core loading our checkpoints at TP2 x PP2 x EP2,
both formats, within 1e-4 in fp32, in the one launch of tests/test_published_parity.py; DeepSeek-V3's pieces keep
their guards in tests/test_family_deepseek_v3.py. The published weights are INT4 (compressed-tensors
`pack-quantized`, quantization_config in the text_config): refused in one line naming the format, since transformers'
integration hands their decompression to the compressed-tensors library, which defines the format."""

from __future__ import annotations

import json

import pytest

from tests.test_convert_bad_input import convert_fails
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.wrapper import open_hf
from toolkit.families import spec_from_config
from toolkit.tinymodels import make_tiny_kimi_k25_multimodal

# The published text_config's quantization_config, in the shape public tests quote it (INT4 groups of 32, symmetric)
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "strategy": "group", "type": "int",
                                                  "symmetric": True}}}}


@pytest.fixture(scope="module")
def tiny_kimi_k25(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-k25")
    return {"fp32": make_tiny_kimi_k25_multimodal(root / "fp32", seed=200),
            "bf16": make_tiny_kimi_k25_multimodal(root / "bf16", "bfloat16", seed=201)}


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py, both formats; all
    must match."""
    pairs = [(models["fp32"], hf_to_megatron(models["fp32"], tmp_path / f"kimi-k25-{fmt}", tp=2, pp=2, ep=2, fmt=fmt,
                                             progress=False)) for fmt in ("torch", "torch_dist")]
    return pairs, len(pairs)


def test_the_language_model_reads_as_deepseek_v3(tiny_kimi_k25):
    view = open_hf(tiny_kimi_k25["fp32"])
    assert json.loads((tiny_kimi_k25["fp32"] / "config.json").read_text())["text_config"]["model_type"] == "kimi_k2"
    spec = spec_from_config(view.config)[1]
    assert (spec.family, spec.mla["q_lora_rank"], spec.num_experts, spec.moe_score_function) == (
        "deepseek_v3", 48, 12, "sigmoid")
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in view.tensors
    assert view.stored_name("model.layers.1.mlp.gate.weight") == "language_model.model.layers.1.mlp.gate.weight"
    assert view.stored_name("lm_head.weight") == "language_model.lm_head.weight"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_wrapper_round_trip_keeps_every_byte(tiny_kimi_k25, tmp_path, fmt):
    """Converted at TP2 x PP2 x EP2 from the wrapper's files, exported back into it: every tensor's bytes (vision
    tower, projector, the float32 expert bias) and the config as they were."""
    src = tiny_kimi_k25["bf16"]
    out = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.parametrize("where", ["text_config", "top level"])
def test_the_published_int4_weights_are_refused_in_one_line_naming_the_format(tiny_kimi_k25, tmp_path, where):
    import shutil

    src = shutil.copytree(tiny_kimi_k25["bf16"], tmp_path / "int4")
    cfg = json.loads((src / "config.json").read_text())
    (cfg["text_config"] if where == "text_config" else cfg)["quantization_config"] = INT4
    (src / "config.json").write_text(json.dumps(cfg))
    convert_fails(src, tmp_path / "out", r"^[^\n]*a quantized kimi_k25 checkpoint \(quantization_config.quant_method="
                  r"'compressed-tensors', format='pack-quantized'\) is not read: its pack-quantized weights are "
                  r"decompressed by the compressed-tensors library[^\n]*$")


def test_the_published_language_model_unquantized_takes_its_norm_eps_in_the_pre_norms_only():
    """Kimi-K2.5's published text_config (tests/data/published_configs kimi-k2.5) less its INT4 quantization_config
    converts (and verifies: tests/test_published_configs.py's launch): its rms_norm_eps is 1e-5 (Kimi-K2's 1e-6), the
    pre-norms' and final norm's (layernorm_epsilon), which HF's q_a_layernorm / kv_a_layernorm never read (they keep
    1e-6: checked on HF's model of that config), nor megatron-core's MLA q / kv norms in our spec
    (toolkit/blocks/norms.py LatentRMSNorm). Refused for it before, in one line (`rms_norm_eps=1e-05 cannot be mapped
    exactly to megatron-core`): those two norms at 1e-5 in HF's own model of the shrunk config moved its fp32 logits
    1.1e-4 (vocabulary 256, 520 tokens) to 1.5e-4 (the corpus' 163840 rows, 64 tokens)."""
    import torch
    import transformers

    from tests import published_corpus as corpus
    from toolkit.megatron_settings import settings_for

    published = corpus.config("kimi-k2.5")
    text = corpus.unquantized_text_config("kimi-k2.5")["text_config"]
    spec = spec_from_config(corpus.language_config({**published, "text_config": text}))[1]
    assert (spec.family, spec.norm_eps, settings_for(spec).transformer["layernorm_epsilon"]) == ("deepseek_v3", 1e-5, 1e-5)
    config = transformers.AutoConfig.for_model("deepseek_v3", **{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        attention = transformers.DeepseekV3ForCausalLM(config).model.layers[0].self_attn
    assert (config.rms_norm_eps, attention.q_a_layernorm.variance_epsilon,
            attention.kv_a_layernorm.variance_epsilon) == (1e-5, 1e-6, 1e-6)
