"""Tensors transformers keeps in float32 (`_keep_in_fp32_modules_strict`): GLM-4.5's and DeepSeek-V3's
expert bias in every release, their router weight (`mlp.gate.weight`) from transformers 5.24
(toolkit/families/float32.py). A bf16 checkpoint saved by 5.23 stores the router in bf16, one saved by
5.24 in float32: both convert, load, verify and export as stored.

Each environment saves the tiny models as its installed transformers does; the other release's save is
made in the same environment by saving with the class's `_keep_in_fp32_modules_strict` set to that
release's list (toolkit.tinymodels `fp32_modules`): in what a bf16 save stores, that list is the whole
difference between the two releases. test_the_tiny_models_save_as_transformers_does checks it against
transformers' own from_pretrained / save_pretrained with the list set on its class, with one exception
it names: 5.24's TopkRouter also creates its weight in float32, so 5.24 itself saves a float32 router
whatever the list. Run in both environments (5.23 and 5.24)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_convert_bad_input import convert_fails, edit_tensors
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.families import FAMILIES, family_for
from toolkit.tinymodels import VARIANTS, make_config, make_tiny_model

# _keep_in_fp32_modules_strict of Glm4MoePreTrainedModel / DeepseekV3PreTrainedModel in each release
SAVED_BY = {"5.23": ("e_score_correction_bias",), "5.24": ("e_score_correction_bias", "gate.weight")}
ROUTER, BIAS = "mlp.gate.weight", "mlp.gate.e_score_correction_bias"
FAMILY_VARIANTS = {"glm4-moe": {}, "deepseek-v3": {"layer_spec": "local"}}
# Families whose published checkpoints store these tensors in float32 though no transformers class keeps them so
# (MiniMax-M2's router weight and expert bias among its bf16 / FP8 weights): flagged so that they convert as stored
PUBLISHED_FLOAT32 = {"minimax_m2": ("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias")}
# Variants whose router lives in layers the tiny model leaves out (Nemotron-H's: in Nemotron 3's E layers), with one
WITH_ROUTER = {"nemotron-h": {"hybrid_override_pattern": "M-*E", "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48}}


def _installed_release() -> str:
    import transformers

    return "5.24" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "5.23"


def full_float32(src, seed: int) -> None:
    """The float32 tensors of a bf16 save given values bf16 cannot hold (the tiny model's went through bf16),
    of their spread: rounding one to bf16 anywhere on the way then shows."""
    generator = torch.Generator().manual_seed(seed)
    edit_tensors(src, lambda t: [v.copy_(torch.randn(v.shape, generator=generator) * v.std())
                                 for v in t.values() if v.dtype == torch.float32])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(variant, release) -> a tiny bf16 model saved as that transformers release saves it, its float32
    tensors with full float32 values."""
    root = tmp_path_factory.mktemp("float32-routers")
    models = {(v, r): make_tiny_model(v, root / f"{v}-{r}", dtype="bfloat16", seed=41, fp32_modules=kept)
              for v in FAMILY_VARIANTS for r, kept in SAVED_BY.items()}
    for seed, src in enumerate(models.values()):
        full_float32(src, seed)
    return models


def _row_of(family, name: str):
    """The row of `family` whose HF tensor `name` is (the layer and expert numbers read as `*` and `#`), `name` a
    module's where the family's modules are named otherwise than its files (Family.module_prefix: Nemotron-H)."""
    stored, module = family.module_prefix or ("", "")
    if module and name.startswith(module):
        name = stored + name[len(module):]
    for r in family.rows:
        for pattern in r.hf:
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+").replace("\\#", r"\d+"), name):
                return r
    return None


def test_the_rows_flagged_float32_cover_what_the_installed_class_keeps_in_float32():
    """For every family, the tensors the installed transformers keeps in float32 in a bf16 model (its model's
    own _keep_in_fp32_modules_strict, matched as transformers matches it) are exactly rows the family flags
    (Row.float32_buffer / float32_parameter): a release that adds one fails here. From 5.24 the flags are
    exactly what it keeps; 5.23 keeps the bias only (the router flag covers the checkpoints 5.24 saves)."""
    from toolkit.families.hf_values import auto_causal_lm  # mistral4 too (transformers maps it otherwise)
    from transformers.core_model_loading import build_glob_alternation

    import transformers

    checked = set()
    for variant, (config_class, _) in VARIANTS.items():
        family = family_for(getattr(transformers, config_class).model_type)
        if family.name in checked:
            continue
        checked.add(family.name)
        with torch.device("meta"):
            model = auto_causal_lm().from_config(make_config(variant, **WITH_ROUTER.get(variant, {})))
        patterns = sorted(model._keep_in_fp32_modules_strict or ())
        names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
        kept = {n for n in names if patterns and build_glob_alternation(patterns)[0].search(n)}
        kept_rows = {_row_of(family, n) for n in kept}
        flagged = {r for r in family.rows if r.kept_in_float32}
        assert None not in kept_rows and kept_rows <= flagged, (family.name, patterns, sorted(kept))
        published = {r for r in flagged if r.hf[0].endswith(PUBLISHED_FLOAT32.get(family.name, ()))}
        assert len(published) == len(PUBLISHED_FLOAT32.get(family.name, ())), family.name
        if _installed_release() == "5.24":
            assert kept_rows == flagged - published, family.name
    # Language models that exist only inside their wrappers (no causal-LM class): what the wrapper keeps in float32
    # (GLM-4.5V's router weight and expert bias; nothing in Qwen3-VL's) is what the family flags
    for name, wrapper in (("qwen3_vl", "Qwen3VLForConditionalGeneration"),
                          ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
                          ("glm4v_moe", "Glm4vMoeForConditionalGeneration"),
                          ("glm4v", "Glm4vForConditionalGeneration")):
        family = next(f for f in FAMILIES if f.name == name)
        patterns = getattr(transformers, wrapper)._keep_in_fp32_modules_strict or ()
        flagged = [r.hf[0] for r in family.rows if r.kept_in_float32]
        assert all(any(f.endswith(p) for f in flagged) for p in patterns), (wrapper, patterns)
        if _installed_release() == "5.24":
            assert all(any(f.endswith(p) for p in patterns) for f in flagged), (name, flagged)
        checked.add(name)
    assert checked == {f.name for f in FAMILIES}


@pytest.mark.parametrize("release", SAVED_BY)
def test_the_tiny_models_save_as_transformers_does(tmp_path, release, monkeypatch):
    """The toolkit's bf16 save with a release's list stores every tensor in the dtype transformers' own
    from_pretrained(dtype=bfloat16) + save_pretrained stores it in with that list set on the class. But
    for 5.23's list under transformers 5.24: its TopkRouter creates the weight in float32
    (modeling_glm4_moe.py / modeling_deepseek_v3.py `torch.zeros(..., dtype=torch.float32)`), so its save
    keeps the router in float32 whatever the list; 5.23 saves it in bf16, as this test under 5.23 shows."""
    import transformers
    from transformers import AutoModelForCausalLM

    router_dtype = torch.float32 if "gate.weight" in SAVED_BY[release] else torch.bfloat16
    for variant in FAMILY_VARIANTS:
        ours = load_all(make_tiny_model(variant, tmp_path / f"ours-{variant}", dtype="bfloat16", seed=5,
                                        fp32_modules=SAVED_BY[release]))
        fp32 = make_tiny_model(variant, tmp_path / f"fp32-{variant}", seed=5)
        architecture = getattr(transformers, family_for(make_config(variant).model_type).architecture)
        owner = next(c for c in architecture.__mro__ if "_keep_in_fp32_modules_strict" in vars(c))
        monkeypatch.setattr(owner, "_keep_in_fp32_modules_strict", list(SAVED_BY[release]))
        AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(tmp_path / f"hf-{variant}")
        monkeypatch.undo()
        theirs = {k: v.dtype for k, v in load_all(tmp_path / f"hf-{variant}").items()}
        assert {v.dtype for k, v in ours.items() if k.endswith(ROUTER)} == {router_dtype}, variant
        if release == "5.23" and _installed_release() == "5.24":
            assert {d for k, d in theirs.items() if k.endswith(ROUTER)} == {torch.float32}, variant
            theirs.update((k, torch.bfloat16) for k in theirs if k.endswith(ROUTER))
        assert {k: v.dtype for k, v in ours.items()} == theirs, variant


def _megatron_router_dtypes(out, fmt: str) -> set[torch.dtype]:
    """The dtypes of the router weights in a converted checkpoint's files."""
    release = out / "release"
    if fmt == "torch_dist":
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(str(release)).read_metadata().state_dict_metadata
        return {v.properties.dtype for k, v in md.items() if k.endswith("mlp.router.weight")}
    from toolkit.convert.torch_format import load_trusted_types

    return {v.dtype for f in release.glob("mp_rank_*/model_optim_rng.pt")
            for k, v in load_trusted_types(f)["model"].items() if k.endswith("mlp.router.weight")}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_either_releases_save_converts_as_stored_and_round_trips_bit_exact(saved, tmp_path, fmt):
    """5.23's and 5.24's saves of both families at TP2 x PP2 x EP2: the megatron checkpoint holds the router
    weight in the dtype the HF file stored it in, the export gives back every tensor bit for bit in its dtype,
    and transformers loads it. Before: 5.24's save was refused (`the router weight 'model.layers.1.mlp.gate.weight'
    is F32 among BF16 weights, as transformers >= 5.24 saves GLM-4.5 / DeepSeek-V3 routers; ... not converted yet`)."""
    from transformers import AutoModelForCausalLM

    for (variant, release), src in saved.items():
        original = load_all(src)
        stored = {v.dtype for k, v in original.items() if k.endswith(ROUTER)}
        assert all(not torch.equal(v, v.bfloat16().float()) for v in original.values() if v.dtype == torch.float32)
        assert stored == {torch.float32 if release == "5.24" else torch.bfloat16}, (variant, release)
        out = hf_to_megatron(src, tmp_path / f"m-{variant}-{release}", tp=2, pp=2, ep=2, fmt=fmt, progress=False,
                             **FAMILY_VARIANTS[variant])
        assert _megatron_router_dtypes(out, fmt) == stored, (variant, release)
        back = megatron_to_hf(out, tmp_path / f"h-{variant}-{release}", progress=False)
        restored = load_all(back)
        assert set(restored) == set(original)
        assert [k for k in original if not (restored[k].dtype == original[k].dtype and torch.equal(restored[k], original[k]))] == []
        model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.bfloat16)
        router = model.model.layers[1].mlp.gate
        assert router.weight.dtype == (torch.float32 if _installed_release() == "5.24" else torch.bfloat16)
        assert torch.equal(router.weight.float(), original[f"model.layers.1.{ROUTER}"].float().to(router.weight.dtype).float())


def test_only_the_router_and_its_bias_may_be_float32_and_each_in_one_dtype(saved, tmp_path):
    """Among bf16 weights a float32 tensor other than the ones transformers keeps so is refused, as is a
    router stored in float32 on one layer and bf16 on another; a float32 router in a family whose class
    never keeps it (Qwen3-MoE) is refused too. Each in one line."""
    import shutil

    src = tmp_path / "mixed"
    shutil.copytree(saved["glm4-moe", "5.24"], src)
    edit_tensors(src, lambda t: t.update({f"model.layers.2.{ROUTER}": t[f"model.layers.2.{ROUTER}"].bfloat16()}))
    convert_fails(src, tmp_path / "out", r"tensor 'model.layers.1.mlp.gate.weight' is F32 but "
                  r"'model.layers.2.mlp.gate.weight' is BF16: transformers saves every `mlp.gate.weight` of a model in one dtype")
    edit_tensors(src, lambda t: t.update({f"model.layers.2.{ROUTER}": t[f"model.layers.2.{ROUTER}"].float(),
                                          "model.norm.weight": t["model.norm.weight"].float()}))
    convert_fails(src, tmp_path / "out", r"tensor 'model.norm.weight' is F32 but config.json says dtype bfloat16")
    qwen = make_tiny_model("qwen3-moe", tmp_path / "qwen", dtype="bfloat16", seed=2)
    edit_tensors(qwen, lambda t: t.update({k: v.float() for k, v in t.items() if k.endswith(ROUTER)}))
    convert_fails(qwen, tmp_path / "out", r"tensor 'model.layers.0.mlp.gate.weight' is F32 but config.json says dtype bfloat16")


@pytest.mark.multiprocess
def test_a_bf16_model_loads_the_router_in_its_dtype_and_the_bias_in_float32_and_verify_passes(saved, tmp_path):
    """Either release's save, both formats, loaded into a one-process bf16 megatron-core model: the router
    weight is a parameter, cast to bf16 (from float32 where 5.24 stored it so), the expert bias a float32
    buffer holding the stored values. `convert verify` (fp32, HF's logits) passes for 5.24's save of both
    families; guard: the same checkpoint with its routers rounded to bf16 is far off HF's logits."""
    from toolkit.convert.parity import verify_many
    from toolkit.runtime.launch import run_on_processes

    cases = {(v, r, fmt): hf_to_megatron(src, tmp_path / f"{v}-{r}-{fmt}", fmt=fmt, progress=False, **FAMILY_VARIANTS[v])
             for (v, r), src in saved.items() for fmt in ("torch", "torch_dist")}
    (loaded,) = run_on_processes("tests.mp_workers:router_tensors_in_bf16_model", 1, [str(c) for c in cases.values()])
    for (variant, release, fmt), held in zip(cases, loaded):
        original = load_all(saved[variant, release])
        routers = {k: v for k, v in held.items() if k.endswith("router.weight")}
        biases = {k: v for k, v in held.items() if k.endswith("router.expert_bias")}
        assert routers and biases, held.keys()
        for name, (dtype, values) in routers.items():
            hf = original[name.replace("decoder.", "model.").replace("mlp.router.weight", ROUTER)]
            assert dtype == "torch.bfloat16" and torch.equal(torch.tensor(values), hf.bfloat16().float()), \
                (variant, release, fmt, name)
        for name, (dtype, values) in biases.items():
            hf = original[name.replace("decoder.", "model.").replace("mlp.router.expert_bias", BIAS)]
            assert dtype == "torch.float32" and torch.equal(torch.tensor(values), hf), (variant, release, fmt, name)

    rounded = tmp_path / "rounded-hf"
    import shutil

    shutil.copytree(saved["glm4-moe", "5.24"], rounded)
    edit_tensors(rounded, lambda t: t.update({k: v.bfloat16().float() for k, v in t.items() if k.endswith(ROUTER)}))
    guard = hf_to_megatron(rounded, tmp_path / "rounded", progress=False)
    pairs = [(saved[v, "5.24"], cases[v, "5.24", fmt]) for v, fmt in (("glm4-moe", "torch"), ("deepseek-v3", "torch_dist"))]
    reports = verify_many(pairs + [(saved["glm4-moe", "5.24"], guard)], tp=1, pp=1, ep=1, cpu=True, progress=False)
    print([f"{r.max_logit_diff:.2e}" for r in reports])
    assert all(r.ok for r in reports[:2]), reports
    assert not reports[2].ok
