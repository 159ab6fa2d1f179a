"""DeepSeek-V3 / Kimi-K2 (deepseek_v3): multi-latent attention with a low-rank or a full query, YaRN with
mscale / mscale_all_dim or plain RoPE, and GLM-4.5's router layout (sigmoid scores with an expert bias,
group-limited top-k, routed scaling, shared experts, a dense first layer) (toolkit/families/deepseek_v3.py,
mla.py, yarn.py). Its router is checked token by token against DeepseekV3TopkRouter in
tests/test_family_glm4_moe.py.

HF is the reference: megatron-core's own MLASelfAttention (local spec) loading our checkpoints at TP2 x PP2 x
EP2 gives HF's logits within 1e-4 in fp32 (in the one launch of tests/test_published_parity.py), both variants,
one per format. Each piece has a guard in that launch: the checkpoint converted with it dropped (YaRN's
mscale / mscale_all_dim, YaRN itself, the group limit, the expert bias) fails the parity check."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from tests.conftest import fp32_and_bf16_models
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_convert_roundtrip import load_all
from tests.test_family_glm4_moe import add_mtp_layer, family_parity_pairs
from tests.test_family_glm4_moe import assert_guards_fail as glm4_moe_guards_fail
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.convert.torch_format import load_trusted_types, rank_file
from toolkit.families import spec_from_config
from toolkit.families import BUFFERS
from toolkit.layouts import Layout
from toolkit.megatron_settings import settings_for
from toolkit.memory.params import stage_param_numels
from toolkit.tinymodels import make_config, make_tiny_model

VARIANTS = ("deepseek-v3", "deepseek-v3-full-q")
# TP2 x PP2 x EP2 on 8 ranks (DP2): EP divides DP, expert TP being TP; megatron-core trains MoE at TP > 1 with SP only
FINE_TUNE_LAYOUT = {"zero_stage": 1, "tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}
LOCAL = {"layer_spec": "local", "progress": False}


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    """variant -> fp32 model (parity), `<variant>-bf16` (round trips in the HF dtype)."""
    return fp32_and_bf16_models(tmp_path_factory.mktemp("deepseek-v3"), VARIANTS, 80, 90)


def test_settings_are_megatron_cores_mla_and_yarn_fields():
    settings = settings_for(spec_from_config(make_config("deepseek-v3").to_dict())[1]).transformer
    assert {k: settings[k] for k in ("multi_latent_attention", "qk_layernorm", "q_lora_rank", "kv_lora_rank",
                                     "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "kv_channels", "rope_type",
                                     "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings",
                                     "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "moe_router_num_groups",
                                     "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_layer_freq")} == {
        "multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "kv_channels": 12, "rope_type": "yarn", "rotary_base": 10000.0,
        "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.7, "mscale_all_dim": 1.0, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
        "moe_router_topk_scaling_factor": 2.5, "moe_layer_freq": [0, 1, 1, 1]}
    full = settings_for(spec_from_config(make_config("deepseek-v3-full-q").to_dict())[1]).transformer
    assert (full["q_lora_rank"], full["rope_type"], full["rotary_scaling_factor"]) == (None, "rope", 1.0)


REFUSALS = (
    ({"attention_bias": True}, "MLASelfAttention has no biases"),
    ({"rope_interleave": False}, "always de-interleaves the rotary dimensions"),
    ({"num_key_value_heads": 2}, "multi-latent attention has a key and value per head"),
    ({"kv_lora_rank": 31}, "qk_rope_head_dim 39 is not divisible by --tp 2"),
)
YARN_REFUSALS = (
    ({"mscale": None}, "mscale_all_dim=1.0 without mscale"),
    ({"attention_factor": 1.5}, "an explicit YaRN attention factor"),
    ({"truncate": False}, "always rounds YaRN's correction range"),
)


def test_the_default_command_converts_for_the_local_spec_and_says_so_in_one_line(tmp_path, capsys):
    """`toolkit convert hf-to-megatron HF OUT` on DeepSeek-V3 as published: multi-latent attention converts for
    megatron-core's local spec only, so without --layer-spec that is the one written, said in one line on
    stderr; an explicit --layer-spec te is refused in one line and nothing is written. Before: the default
    (te) was refused, `converts for megatron-core's local layer spec only: pass --layer-spec local`.
    Guard: a model that takes either spec (Llama) is written with the TE spec's names, without the line."""
    from toolkit.cli import main

    src = make_tiny_model("deepseek-v3", tmp_path / "src", seed=1)
    assert main(["convert", "hf-to-megatron", str(src), str(tmp_path / "m"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    line = ("note: deepseek_v3: layer spec local (multi-latent attention converts for megatron-core's local spec only)")
    assert [e for e in err.splitlines() if "layer spec" in e] == [line], err
    assert CheckpointMeta.read(tmp_path / "m").layer_spec == "local"
    assert main(["convert", "hf-to-megatron", str(src), str(tmp_path / "te"), "--layer-spec", "te"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: deepseek_v3: --layer-spec te refused: multi-latent "
                                                     "attention converts for megatron-core's local spec only"), err
    assert not (tmp_path / "te").exists()
    llama = make_tiny_model("llama", tmp_path / "llama")
    assert main(["convert", "hf-to-megatron", str(llama), str(tmp_path / "llama-m"), "--no-progress"]) == 0
    assert "layer spec" not in capsys.readouterr().err
    assert CheckpointMeta.read(tmp_path / "llama-m").layer_spec == "te"


def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(tmp_path):
    src = make_tiny_model("deepseek-v3", tmp_path / "src", seed=1)
    convert_fails(src, tmp_path / "out", "--layer-spec te refused: multi-latent attention converts for megatron-core's "
                  "local spec only", layer_spec="te")
    published = make_config("deepseek-v3").to_dict()
    for changes, line in REFUSALS:
        edit_config(src, **changes)
        convert_fails(src, tmp_path / "out", line, tp=2, layer_spec="local")
        edit_config(src, **published)
    for changes, line in YARN_REFUSALS:
        rope = {k: v for k, v in {**published["rope_parameters"], **changes}.items() if v is not None}
        edit_config(src, rope_parameters=rope)
        convert_fails(src, tmp_path / "out", line, layer_spec="local")
    edit_config(src, **published)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_deepseek, tmp_path, fmt):
    """Both variants (low-rank and full query), bf16, at TP2 x PP2 x EP2. Each rank's torch file holds
    the tensors `toolkit memory` counts for it (the files megatron-core's MLASelfAttention loads at
    TP2 x PP2 x EP2 in tests/test_published_parity.py): the down projections split over TP as its
    local spec's ColumnParallelLinear, the latent norms whole, local experts only."""
    from transformers import AutoModelForCausalLM

    for variant in VARIANTS:
        src = tiny_deepseek[f"{variant}-bf16"]
        original = load_all(src)
        out = hf_to_megatron(src, tmp_path / f"m-{variant}", tp=2, pp=2, ep=2, fmt=fmt, **LOCAL)
        if fmt == "torch":
            assert_memory_counts_each_rank(out, variant)
        back = megatron_to_hf(out, tmp_path / f"h-{variant}", progress=False)
        restored = load_all(back)
        assert set(restored) == set(original), variant
        assert all(torch.equal(restored[k], original[k]) for k in original), variant
        model = AutoModelForCausalLM.from_pretrained(back)
        assert (model.model.layers[0].self_attn.q_proj is None) == (variant == "deepseek-v3"), variant


def assert_memory_counts_each_rank(out, variant: str) -> None:
    """The parameter tensors of every TP x PP x EP rank file of `out` (TP2 x PP2 x EP2) are the ones
    toolkit.memory.params counts for that rank, buffers (the expert bias) aside."""
    meta = CheckpointMeta.read(out)
    layout = Layout(2, 2, meta.vocab_divisor, 2)
    for tp_rank, pp_rank, ep_rank in itertools.product(range(2), repeat=3):
        stored = load_trusted_types(rank_file(out / "release", layout, tp_rank, pp_rank, ep_rank))["model"]
        numels = sorted(v.numel() for k, v in stored.items() if isinstance(v, torch.Tensor) and not k.endswith(BUFFERS))
        assert numels == sorted(stage_param_numels(meta.model_spec, 2, 2, pp_rank, 2)), (variant, tp_rank, pp_rank, ep_rank)


GUARDS = ("yarn-mscale", "yarn", "group-limit", "expert-bias")


def _dropped(tiny_deepseek, tmp_path, piece: str):
    """A copy of the fp32 low-rank-query model with one piece dropped, converted at TP2 x PP2 x EP2."""
    src = tmp_path / f"ds-no-{piece}"
    shutil.copytree(tiny_deepseek["deepseek-v3"], src)
    rope = make_config("deepseek-v3").to_dict()["rope_parameters"]
    if piece == "yarn-mscale":
        edit_config(src, rope_parameters={k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")})
    elif piece == "yarn":
        edit_config(src, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]})
    elif piece == "group-limit":
        edit_config(src, n_group=1, topk_group=1)
    else:
        edit_tensors(src, lambda t: [v.zero_() for k, v in t.items() if k.endswith("e_score_correction_bias")])
    return hf_to_megatron(src, tmp_path / f"ds-m-no-{piece}", tp=2, pp=2, ep=2, **LOCAL)


def parity_pairs(tiny_deepseek, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 parity launch of tests/test_published_parity.py: the
    low-rank-query YaRN model as per-rank torch files, the full-query RoPE one as torch_dist, the first at
    LARGE_NORM_EPS as torch_dist, then one guard per piece, which must be far off HF's logits; and how many of
    them must match."""
    pairs, matching = family_parity_pairs(tiny_deepseek, VARIANTS, GUARDS, _dropped, tmp_path, layer_spec="local")
    eps = large_norm_eps(tiny_deepseek, tmp_path)
    converted = hf_to_megatron(eps, tmp_path / "ds-eps-dist", tp=2, pp=2, ep=2, fmt="torch_dist", **LOCAL)
    return [*pairs[:matching], (eps, converted), *pairs[matching:]], matching + 1


# rms_norm_eps far from the latent norms' 1e-6, so that an eps of theirs taken from it moves the logits far past 1e-4
LARGE_NORM_EPS = 1e-1


def large_norm_eps(tiny_deepseek, tmp_path):
    """The fp32 low-rank-query model with rms_norm_eps LARGE_NORM_EPS: HF's pre-norms and final norm take it,
    q_a_layernorm and kv_a_layernorm keep 1e-6 (toolkit/blocks/norms.py LatentRMSNorm)."""
    src = shutil.copytree(tiny_deepseek["deepseek-v3"], tmp_path / "ds-eps")
    edit_config(src, rms_norm_eps=LARGE_NORM_EPS)
    return src


def latent_norms_at_rms_norm_eps(model) -> None:
    """HF's model with its q_a_layernorm and kv_a_layernorm at the config's rms_norm_eps, as megatron-core's MLA
    builds its q / kv norms (eps=layernorm_epsilon)."""
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.q_a_layernorm.variance_epsilon = attention.kv_a_layernorm.variance_epsilon = model.config.rms_norm_eps


def test_the_latent_norms_at_rms_norm_eps_move_hfs_logits_past_the_parity_tolerance(tiny_deepseek, tmp_path):
    """The guard of the LARGE_NORM_EPS pair in the parity launch, HF-side: HF's model with its q_a_layernorm and
    kv_a_layernorm at rms_norm_eps, as megatron-core's MLA builds its q / kv norms (eps=layernorm_epsilon), is far
    off HF's own, which keeps them at 1e-6; so a model built so could not pass that launch."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import reference_tokens

    model = AutoModelForCausalLM.from_pretrained(large_norm_eps(tiny_deepseek, tmp_path), dtype=torch.float32)
    tokens = reference_tokens(model.config.vocab_size, 2, 32)
    attention = model.model.layers[0].self_attn
    assert (attention.q_a_layernorm.variance_epsilon, attention.kv_a_layernorm.variance_epsilon) == (1e-6, 1e-6)
    with torch.no_grad():
        hf = model(tokens, use_cache=False).logits
        latent_norms_at_rms_norm_eps(model)
        moved = float((model(tokens, use_cache=False).logits - hf).abs().max())
    print(f"guard, HF's latent norms at rms_norm_eps {LARGE_NORM_EPS}: max |dlogit| {moved:.2e}")
    assert moved > 100 * FP32_TOLERANCE, moved


def assert_guards_fail(reports) -> None:
    glm4_moe_guards_fail(reports, GUARDS)


def test_the_mtp_layer_is_left_out_with_a_line(tiny_deepseek, tmp_path, capfd):
    """DeepSeek-V3's published MTP layer (num_nextn_predict_layers=1, model.layers.<num_hidden_layers>.*),
    which HF's DeepseekV3ForCausalLM ignores on load, is left out saying so, never silently."""
    src = tmp_path / "published"
    shutil.copytree(tiny_deepseek["deepseek-v3-bf16"], src)
    mtp = add_mtp_layer(src, 4)
    out = hf_to_megatron(src, tmp_path / "out", ep=2, **LOCAL)
    assert (f"multi-token-prediction layer(s) (num_nextn_predict_layers=1, {mtp} tensors from model.layers.4.) "
            "are left out") in capfd.readouterr().err
    assert set(load_all(megatron_to_hf(out, tmp_path / "back", progress=False))) == set(load_all(tiny_deepseek["deepseek-v3-bf16"]))


def test_kimi_k2_reads_through_deepseek_v3s_config_class(tiny_deepseek, tmp_path, monkeypatch):
    """Kimi-K2's config.json says model_type "kimi_k2" (unknown to transformers 5.23): the same spec, the
    export keeps the model_type as published, and the recipe fine-tunes it as the DeepSeek-V3 model it is."""
    import json

    from tests.finetune_harness import recipe, recipe_prepare, write_uneven_data

    src = tmp_path / "kimi"
    shutil.copytree(tiny_deepseek["deepseek-v3-bf16"], src)
    edit_config(src, model_type="kimi_k2")
    cfg = json.loads((src / "config.json").read_text())
    assert spec_from_config(cfg)[1] == spec_from_config({**cfg, "model_type": "deepseek_v3"})[1]
    converted = hf_to_megatron(src, tmp_path / "m", tp=2, **LOCAL)
    back = megatron_to_hf(converted, tmp_path / "back", progress=False)
    assert json.loads((back / "config.json").read_text())["model_type"] == "kimi_k2"
    original = load_all(src)
    assert all(torch.equal(t, original[k]) for k, t in load_all(back).items())
    # The recipe takes it at the layout of DeepSeek-V3's fine-tuning launch below, as that model: the same spec
    monkeypatch.setenv("WORLD_SIZE", "8")
    run = recipe_prepare()(str(recipe(tmp_path, converted, write_uneven_data(tmp_path / "data.jsonl", 40),
                                      parallel=FINE_TUNE_LAYOUT)), [])
    assert run.meta.model_spec == spec_from_config({**cfg, "model_type": "deepseek_v3"})[1]
    assert run.layout_key == {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "zero_stage": 1, "vpp": 1}


def test_a_gpu_run_with_transformer_engine_fine_tunes_on_the_local_spec(monkeypatch):
    """On a GPU where Transformer Engine imports the recipe runs the TE spec, but multi-latent attention is
    converted for (and built on) megatron-core's local spec only: the recipe picks local, saying why in its
    one "layer spec" line. CUDA and TE cannot exist here: torch is told CUDA is present and the toolkit that
    TE imported."""
    import toolkit.model
    from tests.test_cuda_shaped import cuda_present

    cuda_present(monkeypatch)
    monkeypatch.setattr(toolkit.model, "te_status", lambda: (True, "transformer_engine 2.9"))
    deepseek, llama = (spec_from_config(make_config(v).to_dict())[1] for v in ("deepseek-v3", "llama"))
    assert toolkit.model.layer_spec_choice(False, llama) == ("te", "transformer_engine 2.9")
    assert toolkit.model.layer_spec_choice(False, deepseek) == (
        "local", "deepseek_v3: multi-latent attention converts for megatron-core's local spec only "
                 "(transformer_engine 2.9)")


@pytest.mark.multiprocess
def test_tp2_pp2_ep2_fine_tune_matches_hf_and_routes_every_token_as_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 with EP2 (8 ranks) on the tiny fp32 DeepSeek-V3 with every feature on
    (low-rank query, YaRN with mscale / mscale_all_dim, a dense first layer, 12 experts in 4 groups with 2
    kept, routed scaling 2.5, 2 shared experts, a random expert bias, rms_norm_eps LARGE_NORM_EPS with the latent
    norms at 1e-6), on megatron-core's local layer spec with sequence parallelism:
    HF's losses and gradient norms over 10 steps, every step's tokens per expert as HF's routers chose them,
    the expert bias as loaded (neither side updates it), and the export loads in transformers. Guards: the
    reference with the expert bias zeroed, with YaRN's mscales dropped, or with its latent norms at rms_norm_eps, is
    far off the run."""
    from transformers import AutoModelForCausalLM

    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import family_finetune_parity
    from tests.test_family_glm4_moe import _routing_reference

    reference = _routing_reference()
    run = family_finetune_parity(tmp_path, "deepseek-v3", 8, FINE_TUNE_LAYOUT, lambda hf: reference, export_hf=True,
                                 layer_spec=LOCAL["layer_spec"], seed=81, rms_norm_eps=LARGE_NORM_EPS)
    hf, data, cfg, metrics = run.hf, run.data, run.cfg, run.metrics
    print(f"DeepSeek-V3 TP2xPP2xDP2 EP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in metrics] == reference.routing
    assert len(reference.routing[0]) == 3
    exported, original = load_all(tmp_path / "run" / "hf"), load_all(hf)
    biases = [k for k in original if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(exported[k], original[k]) for k in biases)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").model.layers[0].self_attn.q_proj is None

    for piece in ("expert-bias", "yarn-mscale", "latent-norms-at-1e-6"):
        guard = shutil.copytree(hf, tmp_path / f"hf-no-{piece}")
        if piece == "expert-bias":
            edit_tensors(guard, lambda t: [v.zero_() for k, v in t.items() if k.endswith("e_score_correction_bias")])
        elif piece == "yarn-mscale":
            rope = make_config("deepseek-v3").to_dict()["rope_parameters"]
            edit_config(guard, rope_parameters={k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")})
        off = differences(metrics, *hf_reference(guard, data, cfg, STEPS, prepare=latent_norms_at_rms_norm_eps
                                                 if piece == "latent-norms-at-1e-6" else None))
        print(f"guard, HF without {piece}: {off[0]:.1e} / {off[1]:.1e}")
        assert off[0] > 100 * LOSS_TOLERANCE_FP32, piece
