"""Mixture-of-Experts checkpoints with dense MLP layers among the MoE ones (Qwen3-MoE / Qwen2-MoE
`mlp_only_layers`, `decoder_sparse_step` != 1): the layer pattern read as HF builds the model,
megatron-core's moe_layer_freq as a list, each layer kind's rows of the family table converted
and exported bit-exact, and megatron-core's own checkpointing as the judge of the torch_dist layout
(keyed per layer where kinds mix). Logit parity at TP2 x PP2 x EP2: tests/test_published_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests import test_family_qwen3_next as qwen3_next
from tests.test_family_glm4_moe import assert_native_layout, native_check_case, tiny_glm  # noqa: F401  (fixture)
from tests.test_family_qwen3_next import tiny_qwen3_next  # noqa: F401  (fixture)
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.memory.params import stage_param_numels
from toolkit.runtime.launch import run_on_processes
from toolkit.tinymodels import make_config

DENSE_LAYER_VARIANTS = {"qwen3-moe-dense-layers": "0011", "qwen2-moe-sparse-step": "0101"}


@pytest.fixture(scope="module")
def dense_layer_moe(tmp_path_factory):
    """variant -> fp32 model (parity), `<variant>-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("moe-dense-layers"), DENSE_LAYER_VARIANTS, 80, 90)


@pytest.mark.parametrize("variant, changes", [
    ("qwen3-moe", {"mlp_only_layers": [0, 1]}), ("qwen3-moe", {"mlp_only_layers": [3]}),
    ("qwen3-moe", {"decoder_sparse_step": 3}), ("qwen2-moe", {"decoder_sparse_step": 2}),
    ("qwen2-moe", {"decoder_sparse_step": 2, "mlp_only_layers": [1]}), ("qwen3-moe", {}),
])
def test_layer_kinds_are_the_ones_hf_builds(variant, changes):
    from transformers import AutoModelForCausalLM

    config = make_config(variant, **changes)
    spec = spec_from_config(config.to_dict())[1]
    hf = "".join("1" if hasattr(layer.mlp, "experts") else "0" for layer in AutoModelForCausalLM.from_config(config).model.layers)
    assert (spec.moe_layers or "1" * spec.num_layers) == hf
    freq = settings_for(spec).transformer["moe_layer_freq"]
    assert freq == ([int(c) for c in hf] if "0" in hf else 1)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(dense_layer_moe, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    for variant, pattern in DENSE_LAYER_VARIANTS.items():
        src = dense_layer_moe[f"{variant}-bf16"]
        original = load_all(src)
        for tp, pp, ep in ((2, 2, 2), (1, 1, 1)):
            out = hf_to_megatron(src, tmp_path / f"m-{variant}-{tp}{pp}{ep}", tp=tp, pp=pp, ep=ep, fmt=fmt, progress=False)
            assert CheckpointMeta.read(out).model_spec.moe_layers == pattern
            back = megatron_to_hf(out, tmp_path / f"h-{variant}-{tp}{pp}{ep}", progress=False)
            restored = load_all(back)
            assert set(restored) == set(original), variant
            assert all(torch.equal(restored[k], original[k]) for k in original), variant
    model = AutoModelForCausalLM.from_pretrained(back)
    assert not hasattr(model.model.layers[0].mlp, "experts") and hasattr(model.model.layers[1].mlp, "experts")


@pytest.mark.multiprocess
def test_torch_dist_is_megatron_cores_own_layout_and_memory_counts_each_kind(dense_layer_moe, tiny_glm,  # noqa: F811
                                                                           tiny_qwen3_next, tmp_path):  # noqa: F811
    """megatron-core loads our torch_dist (written at TP2 x PP2 x EP2) into a one-process model built
    with moe_layer_freq as a list and saves the same tensors back, keyed per layer (plus each MoE
    layer's pre-MLP norm under the TE spec's key); `toolkit memory` counts the same parameters."""
    cases = []
    for variant in DENSE_LAYER_VARIANTS:
        convert = lambda name, src=dense_layer_moe[variant], **kw: hf_to_megatron(  # noqa: E731
            src, tmp_path / f"{variant}-{name}", progress=False, **kw)
        cases.append({"dist": str(convert("dist", tp=2, pp=2, ep=2, fmt="torch_dist")),
                      "te_torch": str(convert("te", layer_spec="te")),
                      "bf16_dist": str(convert("bf16", src=dense_layer_moe[f"{variant}-bf16"], ep=2, fmt="torch_dist")),
                      "resave": str(tmp_path / f"{variant}-resaved")})
    (results,) = run_on_processes("tests.mp_workers:megatron_native_checks", 1,
                                  cases + [native_check_case(tiny_glm, tmp_path),
                                           qwen3_next.native_check_case(tiny_qwen3_next, tmp_path)])
    qwen3_next.assert_native_layout(results.pop())  # Qwen3-Next's (tests/test_family_qwen3_next.py)
    assert_native_layout(results.pop())  # GLM-4.5's (tests/test_family_glm4_moe.py)
    for (variant, pattern), case, result in zip(DENSE_LAYER_VARIANTS.items(), cases, results):
        aliases = {f"decoder.layers.{i}.pre_mlp_layernorm.weight": result["megatrons"][
            f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"] for i, kind in enumerate(pattern) if kind == "1"}
        assert result["ours"] == {**result["megatrons"], **aliases}, variant
        for i, kind in enumerate(pattern):  # a router on the MoE layers only, a dense MLP on the others
            assert (f"decoder.layers.{i}.mlp.router.weight" in result["ours"]) == (kind == "1"), (variant, i)
            assert (f"decoder.layers.{i}.mlp.linear_fc1.weight" in result["ours"]) == (kind == "0"), (variant, i)
        spec = CheckpointMeta.read(Path(case["dist"])).model_spec
        assert sorted(stage_param_numels(spec, 1, 1, 0)) == result["param_numels"], variant
        assert {v[1] for v in result["bf16_source"].values() if v != "bytes"} == {"torch.bfloat16"}, variant


@pytest.mark.multiprocess
def test_expert_parallel_fine_tune_with_a_stage_of_dense_layers_only_matches_hf(tmp_path):
    """Qwen3-MoE with its first two layers dense at PP2 x DP2 x EP2: stage 0 holds no expert (as
    DeepSeek-V3's and GLM-4.5's first stages do at a large PP). DeepSpeed asserted on it, and with that
    lifted the step hung: ZeRO all-reduces each param group's norm over TP x PP and the dense stage had
    fewer groups (toolkit/train/experts.py align_group_count). HF's losses, gradient norms and routing."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, differences
    from tests.test_moe_finetune import assert_routed_as_the_reference, moe_setup, run

    (tmp_path / "model").mkdir()
    setup = moe_setup(tmp_path / "model", "qwen3-moe-dense-layers")
    cfg, metrics = run(setup, tmp_path, 4, {"zero_stage": 1, "pp": 2, "ep": 2})
    reference = setup[3](cfg)
    assert all(not any(map(any, m["tokens_per_expert"][:2])) for m in metrics)  # the dense layers route nothing
    assert_routed_as_the_reference([{**m, "tokens_per_expert": m["tokens_per_expert"][2:]} for m in metrics], reference)
    loss, norm = differences(metrics, *reference[:2])
    print(f"Qwen3-MoE, dense stage 0, PP2xDP2xEP2: max |loss - HF| {loss:.1e}, grad norm relative {norm:.1e}")
    assert len(metrics) == 10 and loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)