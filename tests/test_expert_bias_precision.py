"""The expert bias (GLM-4.5's and DeepSeek-V3's `e_score_correction_bias`) is float32 in the published
bf16 checkpoints, and megatron-core keeps it float32 (router.py `_maintain_float32_expert_bias`).
DeepSpeed's bf16 engine casts the whole module, buffers included, to bf16 when it is built: without
care the bias a bf16 run routes with, saves and exports is the checkpoint's rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from tests.test_convert_bad_input import edit_tensors
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron
from toolkit.tinymodels import make_tiny_model

BIAS = "e_score_correction_bias"


@pytest.mark.multiprocess
def test_a_bf16_run_keeps_and_exports_the_float32_expert_bias_bit_for_bit(tmp_path):
    """One bf16 step of a tiny GLM-4.5 saved as transformers saves it (bf16 weights, float32 expert
    bias with values bf16 cannot hold); neither side updates the bias, so the export must hold the
    checkpoint's float32 values exactly. The model is saved as the *other* transformers release saves it
    (tests/test_float32_routers.py): its router weight in bf16 under 5.24, in float32 under 5.23; the
    export writes every tensor as the installed transformers keeps it, whatever the source stored:
    the dtypes of transformers' own from_pretrained(dtype=bfloat16) + save_pretrained of the export."""
    from transformers import AutoModelForCausalLM

    from tests.finetune_harness import launch, recipe, write_uneven_data
    from tests.test_float32_routers import ROUTER, SAVED_BY, _installed_release

    other = SAVED_BY["5.23" if _installed_release() == "5.24" else "5.24"]
    hf = make_tiny_model("glm4-moe", tmp_path / "hf", dtype="bfloat16", vocab_size=250, seed=81, fp32_modules=other)
    source_routers = {v.dtype for k, v in load_all(hf).items() if k.endswith(ROUTER)}
    generator = torch.Generator().manual_seed(81)  # the tiny model's bias went through bf16: full float32 values
    edit_tensors(hf, lambda t: [v.copy_(torch.randn(v.shape, generator=generator) * 1e-2)
                                for k, v in t.items() if k.endswith(BIAS)])
    original = {k: v for k, v in load_all(hf).items() if k.endswith(BIAS)}
    assert original and all(v.dtype == torch.float32 for v in original.values())
    assert all(not torch.equal(v, v.bfloat16().float()) for v in original.values())  # bf16 would round them
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    data = write_uneven_data(tmp_path / "data.jsonl", 16)
    cfg = recipe(tmp_path, mc, data, precision="bf16", steps=1, global_batch=4, export_hf=True)
    launch(1, cfg)
    exported = load_all(tmp_path / "run" / "hf")
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.bfloat16).save_pretrained(tmp_path / "resaved")
    assert {k: v.dtype for k, v in exported.items()} == {k: v.dtype for k, v in load_all(tmp_path / "resaved").items()}
    assert {v.dtype for k, v in exported.items() if k.endswith(ROUTER)} != source_routers
    for name, value in original.items():
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], value), (name, (exported[name] - value).abs().max())
