"""DeepSeek-V3.2 (deepseek_v32): DeepSeek-V3's multi-latent attention, YaRN and router (tests/test_family_deepseek_v3.py)
with DeepSeek Sparse Attention's lightning indexer in every layer, as megatron-core 0.19's DSAttention / DSAIndexer in
the local spec's MLASelfAttention (toolkit/families/dsa.py, toolkit/blocks/attention_dsa.py).

HF is the reference: the indexer alone keeps the same top-k keys as HF's DeepseekV32Indexer for every query (in
process, world of one); the whole model at TP2 x PP2 x EP2 in both formats gives HF's logits within 1e-4 in fp32 (in
the one launch of tests/test_published_parity.py), on 32 tokens with index_topk 8, so most queries attend to a
quarter of their keys. Guards: in process, the indexer's RoPE, ReLU and k_norm each dropped change which keys are
kept; in the launch, the top-k disabled (dense attention) and k_norm's weight and bias reset are far off HF's logits."""

from __future__ import annotations

import copy
import json
import re
import shutil
import types

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_roundtrip import load_all
from tests.test_family_deepseek_v3 import assert_memory_counts_each_rank
from tests.test_family_glm4_moe import family_parity_pairs
from tests.test_family_glm4_moe import assert_guards_fail as glm4_moe_guards_fail
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.runtime import megatron_versions
from toolkit.tinymodels import make_config, make_tiny_model

VARIANT = "deepseek-v32"
LOCAL = {"layer_spec": "local", "progress": False}
SEQ = 32


@pytest.fixture(scope="module")
def tiny_deepseek_v32(tmp_path_factory):
    """fp32 model (parity) and `deepseek-v32-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("deepseek-v32"), (VARIANT,), 110, 120)


def test_settings_are_megatron_cores_dsa_fields():
    settings = settings_for(spec_from_config(make_config(VARIANT).to_dict())[1]).transformer
    assert {k: v for k, v in settings.items() if k.startswith("dsa_") or k == "experimental_attention_variant"} == {
        "experimental_attention_variant": "dsa", "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 16,
        "dsa_indexer_topk": 8, "dsa_indexer_rotate_activation": False, "dsa_indexer_rope_interleaved": False,
        "dsa_indexer_scoring_relu": True, "dsa_indexer_k_norm_epsilon": 1e-6, "dsa_indexer_topk_freq": 1,
        "dsa_indexer_skip_topk_offset": 0}
    assert settings["multi_latent_attention"] and settings["q_lora_rank"] == 48


def _kept(top: torch.Tensor) -> torch.Tensor:
    """[batch, query, key] True where the query keeps the key among its causal ones (HF fills a short row's top-k
    with masked keys, megatron-core with -1: neither is kept)."""
    batch, seq, _ = top.shape
    top = top.long()
    top = torch.where((top >= 0) & (top <= torch.arange(seq)[None, :, None]), top, seq)
    return torch.zeros(batch, seq, seq + 1, dtype=torch.bool).scatter_(-1, top, True)[..., :seq]


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone, which megatron-core's RoPE asks its CP group from.
    The session's DeepSpeed oracle (tests/ds_oracle.py) may hold one already in this worker: then it
    is used as it is and left to its owner."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        yield types.SimpleNamespace(tp=dist.group.WORLD, cp=dist.group.WORLD)
    finally:
        if owned:
            dist.destroy_process_group()


def test_the_indexer_keeps_hfs_top_k_keys_and_each_piece_matters(world_of_one, monkeypatch):
    """megatron-core's DSAIndexer of the toolkit's local modules, given HF's DeepseekV32Indexer's weights (random,
    k_norm's too), keeps exactly HF's top-8 keys of every query of 2 x 32 tokens (YaRN RoPE as the model's).
    Guards: its RoPE interleaved, or left out, its scores without ReLU, or k_norm skipped, each keep other keys."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    same, differ = indexer_against_hf(VARIANT, hf.DeepseekV32Indexer, hf.DeepseekV32RotaryEmbedding, world_of_one,
                                      monkeypatch, {"rope interleaved": {"dsa_indexer_rope_interleaved": True}})
    assert same and all(count > 50 for count in differ.values()), differ


def indexer_against_hf(variant: str, hf_indexer, hf_rotary, group, monkeypatch, broken_configs: dict) -> tuple[bool, dict]:
    """(whether megatron-core's indexer keeps HF's keys for every query, {guard: how many (query, key) pairs it keeps
    otherwise}) for `variant`'s indexer, its guards: `broken_configs` (name -> TransformerConfig fields), no ReLU, no
    RoPE, no k_norm."""
    from megatron.core.transformer.spec_utils import build_module

    from toolkit.blocks.attention_dsa import dsa_core_attention
    from toolkit.blocks.attention_mla import buildable_mla
    from toolkit.layouts import Layout
    from toolkit.model import transformer_config

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # as cpu_compat does in a rank
    cfg = make_config(variant)
    config = transformer_config(spec_from_config(cfg.to_dict())[1], Layout(1, 1), torch.float32, layer_spec="local")
    with buildable_mla(config):
        indexer = build_module(dsa_core_attention().submodules.indexer, config=config, pg_collection=group)
    reference = hf_indexer(cfg, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, theirs in (("linear_wq_b.weight", reference.wq_b.weight), ("linear_wk.weight", reference.wk.weight),
                             ("k_norm.weight", reference.k_norm.weight), ("k_norm.bias", reference.k_norm.bias),
                             ("linear_weights_proj.weight", reference.weights_proj.weight)):
            theirs.copy_(torch.randn(theirs.shape, generator=g) * 0.3 + (name == "k_norm.weight"))
            indexer.get_parameter(name).copy_(theirs)
    x, q_r = torch.randn(2, SEQ, 64, generator=g), torch.randn(2, SEQ, 48, generator=g)
    positions = torch.arange(SEQ)[None].expand(2, SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None].expand(2, SEQ, SEQ)
    hf_kept = _kept(reference(x, q_r, hf_rotary(cfg)(x, positions), causal, positions))
    mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1)

    def kept_keys() -> torch.Tensor:
        return _kept(indexer.forward_with_scores(x.transpose(0, 1), q_r.transpose(0, 1), mask)[1])

    same = torch.equal(kept_keys(), hf_kept) and int(hf_kept.sum()) == 2 * sum(min(8, s + 1) for s in range(SEQ))
    differ = {}
    for piece, change in {**broken_configs, "no relu": {"dsa_indexer_scoring_relu": False}}.items():
        broken = copy.copy(config)
        vars(broken).update(change)
        with monkeypatch.context() as m:
            m.setattr(indexer, "config", broken)
            differ[piece] = int((kept_keys() != hf_kept).sum())
    for piece, module, name in (("no rope", indexer, "_apply_rope"), ("no k_norm", indexer.k_norm, "forward")):
        with monkeypatch.context() as m:
            m.setattr(module, name, lambda t, *args, **kwargs: t)
            differ[piece] = int((kept_keys() != hf_kept).sum())
    print(variant, differ)
    return same, differ


def _write_config(src, **changes) -> None:
    """config.json with `changes`, a None written as null (edit_config drops the key instead)."""
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **changes}))


def test_what_the_indexer_cannot_be_is_refused_in_one_line(tmp_path, monkeypatch):
    src = make_tiny_model(VARIANT, tmp_path / "src", seed=1)
    published = json.loads((src / "config.json").read_text())
    for changes, line in (({"q_lora_rank": None}, "Field 'q_lora_rank' expected int"),  # transformers' own refusal
                          ({"index_head_dim": 6}, "index_head_dim=6 is below qk_rope_head_dim=8"),
                          ({"index_topk": 0}, "index_topk=0; expected a positive integer"),
                          ({"mlp_layer_types": ["sparse"] * 4}, "is not first_k_dense_replace=1 dense layers")):
        _write_config(src, **changes)
        convert_fails(src, tmp_path / "out", re.escape(line), layer_spec="local")
        (src / "config.json").write_text(json.dumps(published))
    from packaging.version import Version

    monkeypatch.setattr(megatron_versions, "installed", lambda: Version("0.18.0"))
    convert_fails(src, tmp_path / "out", re.escape("cannot be computed as HF does on megatron-core 0.18.0"),
                  layer_spec="local")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_deepseek_v32, tmp_path, fmt):
    """bf16 at TP2 x PP2 x EP2: every tensor back bit for bit, the indexer's included; each rank's torch file holds
    the tensors `toolkit memory` counts for it (the indexer whole on every TP rank)."""
    assert_round_trip(tiny_deepseek_v32[f"{VARIANT}-bf16"], VARIANT, tmp_path, fmt, "DeepseekV32ForCausalLM")


def assert_round_trip(src, variant: str, tmp_path, fmt: str, architecture: str) -> None:
    """`src` at TP2 x PP2 x EP2 in `fmt` and back: every tensor bit for bit in its dtype (the indexers' among them),
    each torch rank file what `toolkit memory` counts for it, and transformers loads the export as `architecture`."""
    from transformers import AutoModelForCausalLM

    original = load_all(src)
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, **LOCAL)
    if fmt == "torch":
        assert_memory_counts_each_rank(out, variant)
    restored = load_all(megatron_to_hf(out, tmp_path / "h", progress=False))
    assert set(restored) == set(original) and any(".indexer." in k for k in original)
    assert all(torch.equal(restored[k], original[k]) and restored[k].dtype == original[k].dtype for k in original)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "h")).__name__ == architecture


GUARDS = ("topk", "k_norm")


def _dropped(models, tmp_path, piece: str):
    """A copy of the fp32 model with one piece dropped, converted at TP2 x PP2 x EP2: the indexer's top-k (index_topk
    64, more than the tokens: dense attention), or k_norm's weight and bias reset to LayerNorm's 1 and 0."""
    src = tmp_path / f"dsv32-no-{piece}"
    shutil.copytree(models[VARIANT], src)
    if piece == "topk":
        edit_config(src, index_topk=64)
    else:
        edit_tensors(src, lambda t: [v.fill_(float(k.endswith("weight"))) for k, v in t.items() if ".indexer.k_norm." in k])
    return hf_to_megatron(src, tmp_path / f"dsv32-m-no-{piece}", tp=2, pp=2, ep=2, **LOCAL)


def parity_pairs(tiny_deepseek_v32, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py: the model as
    per-rank torch files and as torch_dist, then one guard per piece; and how many of them must match."""
    return family_parity_pairs(tiny_deepseek_v32, (VARIANT, VARIANT), GUARDS, _dropped, tmp_path, layer_spec="local")


def assert_guards_fail(reports) -> None:
    glm4_moe_guards_fail(reports, GUARDS)


@pytest.mark.skipif(not megatron_versions.exact_dsa(), reason="DSA converts on megatron-core >= 0.19 only")
def test_fine_tuning_is_refused_in_one_line_until_it_trains_as_hf(tiny_deepseek_v32, tmp_path):
    """Measured at TP2 x EP2 with SP against HF's DeepseekV32ForCausalLM trained by torch AdamW (tests/moe_reference.py's
    per-document reference): the first step's loss 4.1e-4 off (5.628924 against 5.628518), though the logits verify
    within 1e-6 (the parity launch). Until that is found, the recipe refuses before any process starts."""
    from tests.test_finetune_inputs import recipe_file
    from toolkit.errors import ToolkitError
    from toolkit.train import build
    from toolkit.train.config import load_config

    mc = hf_to_megatron(tiny_deepseek_v32[VARIANT], tmp_path / "mc", fmt="torch_dist", **LOCAL)
    cfg = load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["data.seq_len=32"])
    with pytest.raises(ToolkitError, match=r"^fine-tuning deepseek_v32 \(DeepSeek Sparse Attention\) is not supported "
                                           r"yet[^\n]*convert verify[^\n]*$"):
        build.check_layout(cfg, 1, build.read_checkpoint_meta(cfg))
