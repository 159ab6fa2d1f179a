"""Mistral 4 / Mistral Small 4 (mistral4; published as the wrapper mistral3, Mistral3ForConditionalGeneration):
DeepSeek-V3's multi-latent attention and MoE layout with Mistral 4's differences (toolkit/families/mistral4.py):
a softmax router without expert bias, experts fused as transformers 5 stores them, the MLA head's rotary share,
the Llama-4 query scale (exact up to original_max_position_embeddings).

HF is the reference: megatron-core's MLASelfAttention (local spec) loading our checkpoints at TP2 x PP2 x EP2 gives
HF's logits within 1e-4 in fp32, the text model as per-rank torch files and the wrapper's language model as
torch_dist, in the one launch of tests/test_published_parity.py, with a guard per new piece there (the checkpoint
converted with it dropped fails the parity check); the Llama-4 query scale's guard is HF-side here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import text_and_wrapper_models
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_glm4_moe import assert_guards_fail as glm4_moe_guards_fail
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_mistral3_multimodal, make_tiny_model

TEXT, VL = "mistral4", "vl"
LM = "language_model."
# TP2 x PP2 x EP2 on 8 ranks (DP2), as DeepSeek-V3's fine-tune
FINE_TUNE_LAYOUT = {"zero_stage": 1, "tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}


@pytest.fixture(scope="module")
def tiny_mistral4(tmp_path_factory):
    """The text model and the wrapper, fp32 (parity) and `-bf16` (round trips), each seeded on its own."""
    return text_and_wrapper_models(tmp_path_factory.mktemp("mistral4"), TEXT, make_tiny_mistral3_multimodal, 170, VL)


def test_settings_are_deepseek_v3s_mla_with_a_softmax_router():
    spec = spec_from_config(make_config(TEXT).to_dict())[1]
    s = settings_for(spec).transformer
    assert {k: s.get(k) for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                              "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_percent",
                              "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_score_function",
                              "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_num_groups",
                              "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                              "moe_layer_freq")} == {
        "multi_latent_attention": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "rope_type": "yarn", "rotary_percent": 1.0,
        "rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False, "moe_router_enable_expert_bias": None, "moe_router_num_groups": None,
        "moe_router_topk_scaling_factor": 1.5, "moe_shared_expert_intermediate_size": 48, "moe_layer_freq": [0, 1, 1, 1]}
    assert spec.exact_seq_len == 64 and s.get("moe_router_dtype") is None  # HF's router runs in the model's dtype
    unscaled = make_config(TEXT).to_dict()
    unscaled["rope_parameters"] = {**unscaled["rope_parameters"], "llama_4_scaling_beta": 0.0}
    assert spec_from_config(unscaled)[1].exact_seq_len is None


REFUSALS = (
    ({"n_group": 2, "topk_group": 1}, "HF ranks Mistral 4's groups by the top-2 of the softmax scores"),
    ({"rope_interleave": False}, "always de-interleaves the rotary dimensions"),
    ({"attention_bias": True}, "MLASelfAttention has no biases"),
    ({"num_key_value_heads": 2}, "multi-latent attention has a key and value per head"),
)


def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(tmp_path):
    src = make_tiny_model(TEXT, tmp_path / "src", seed=1)
    published = json.loads((src / "config.json").read_text())
    for changes, line in REFUSALS:
        edit_config(src, **changes)
        convert_fails(src, tmp_path / "out", line)
        (src / "config.json").write_text(json.dumps(published))
    rope = published["rope_parameters"]
    edit_config(src, rope_parameters={**rope, "partial_rotary_factor": 1.0})
    convert_fails(src, tmp_path / "out", "its RoPE rotates the qk_rope_head_dim=8 of each 24-dimensional head")
    (src / "config.json").write_text(json.dumps(published))
    wrapper = make_tiny_mistral3_multimodal(tmp_path / "vl", seed=2)
    edit_config(wrapper, quantization_config={"quant_method": "fp8", "activation_scheme": "static"})
    convert_fails(wrapper, tmp_path / "out", "a quantized mistral3 checkpoint .quantization_config.quant_method='fp8'. "
                  "is not read")


def test_training_past_the_exact_length_is_refused_in_one_line(tiny_mistral4, tmp_path):
    """The recipe refuses data.seq_len past original_max_position_embeddings (64 here, 8192 as published), where
    HF's Llama-4 query scale leaves 1, and `verify` a --seq-len past it, each in one line; at the bound it starts."""
    from tests.finetune_harness import recipe, recipe_prepare, write_uneven_data
    from toolkit.errors import ToolkitError

    converted = hf_to_megatron(tiny_mistral4[f"{TEXT}-bf16"], tmp_path / "m", progress=False)
    data = write_uneven_data(tmp_path / "data.jsonl", 40)
    with pytest.raises(ToolkitError, match="data.seq_len 65 exceeds 64, the longest sequence mistral4 trains exactly"):
        recipe_prepare()(str(recipe(tmp_path, converted, data, data__seq_len=65)), [])
    assert recipe_prepare()(str(recipe(tmp_path, converted, data, data__seq_len=64)), []).meta.model_spec.family == TEXT
    from toolkit.convert.parity import verify_many

    with pytest.raises(ToolkitError, match="--seq-len 65 exceeds 64, the longest sequence mistral4 converts exactly for"):
        verify_many([(tiny_mistral4[f"{TEXT}-bf16"], converted)], seq_len=65)


def _hf_logits(src, tokens, **config):
    from toolkit.families.hf_values import auto_causal_lm

    model = auto_causal_lm().from_pretrained(src, dtype=torch.float32, **config).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_llama4_query_scale_is_one_up_to_its_bound_and_moves_the_logits_past_it(tiny_mistral4):
    """HF's get_llama_4_attn_scale: 1 + beta log(1 + floor(position / 64)) is exactly 1 on the first 64
    positions, so with or without it the logits are the same bit for bit there (what the conversion and the
    recipe rely on); past them it moves the logits far more than the parity tolerance (why longer training is
    refused rather than run inexactly)."""
    src = tiny_mistral4[TEXT]
    rope = make_config(TEXT).to_dict()["rope_parameters"]
    tokens = torch.randint(0, 251, (2, 128), generator=torch.Generator().manual_seed(0))
    scaled, unscaled = _hf_logits(src, tokens), _hf_logits(src, tokens, rope_parameters={**rope, "llama_4_scaling_beta": 0.0})
    assert torch.equal(scaled[:, :64], unscaled[:, :64])
    moved = float((scaled[:, 64:] - unscaled[:, 64:]).abs().max())
    print(f"Llama-4 query scale past 64 positions: max |dlogit| {moved:.2e}")
    assert moved > 100 * FP32_TOLERANCE


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_round_trips_bit_exactly(tiny_mistral4, tmp_path, fmt):
    """bf16 at TP2 x PP2 x EP2: the fused experts come back fused, byte for byte, and load in transformers."""
    from toolkit.families.hf_values import auto_causal_lm

    src = tiny_mistral4[f"{TEXT}-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "back", progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in tensor_hashes(src))
    assert json.loads((back / "config.json").read_text())["architectures"] == ["Mistral4ForCausalLM"]
    assert type(auto_causal_lm().from_pretrained(back)).__name__ == "Mistral4ForCausalLM"


def test_wrapper_round_trip_keeps_every_byte_and_loads_as_the_multimodal_class(tiny_mistral4, tmp_path):
    """Converted from the wrapper's files (language_model.model.*, language_model.lm_head, the fused experts read
    under the wrapper's names), exported back into it: every tensor (Pixtral tower, projector, language model)
    byte-identical, the config untouched, loaded by transformers' multimodal class; exported alone, the language
    model as Mistral4ForCausalLM with the same bytes under the text model's names."""
    import transformers

    src = tiny_mistral4[f"{VL}-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt="torch_dist", progress=False)
    assert CheckpointMeta.read(out).model_spec.family == "mistral4"
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    original = tensor_hashes(src)
    assert tensor_hashes(back) == original and (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert any(n.startswith("vision_tower.") for n in original) and any(n.startswith("multi_modal_projector.") for n in original)
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(back)).__name__ == "Mistral3ForConditionalGeneration"
    text = megatron_to_hf(out, tmp_path / "text", progress=False)
    assert tensor_hashes(text) == {n[len(LM):]: h for n, h in original.items() if n.startswith(LM)}
    assert json.loads((text / "config.json").read_text())["architectures"] == ["Mistral4ForCausalLM"]


def test_the_wrapper_ties_as_its_own_config_says(tmp_path):
    """Mistral3ForConditionalGeneration ties lm_head to the embeddings as its top-level tie_word_embeddings says
    (Mistral3Config's default true), whatever its text_config says: a wrapper that leaves the flag out is read
    tied, as transformers builds it; the published one says false."""
    from toolkit.convert.wrapper import open_hf

    src = make_tiny_mistral3_multimodal(tmp_path / "vl", seed=3)
    assert open_hf(src).config["tie_word_embeddings"] is False
    edit_config(src, tie_word_embeddings=None)
    assert open_hf(src).config["tie_word_embeddings"] is True


GUARDS = ("yarn-mscale", "renormalise", "routed-scaling", "gate-up-halves")


def _dropped(models, tmp_path, piece: str):
    """A copy of the fp32 text model with one piece dropped or laid out otherwise, converted at TP2 x PP2 x EP2."""
    src = tmp_path / f"m4-no-{piece}"
    shutil.copytree(models[TEXT], src)
    rope = make_config(TEXT).to_dict()["rope_parameters"]
    if piece == "yarn-mscale":
        edit_config(src, rope_parameters={k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")})
    elif piece == "renormalise":
        edit_config(src, norm_topk_prob=False)
    elif piece == "routed-scaling":
        edit_config(src, routed_scaling_factor=1.0)
    else:  # [up; gate] where HF stacks [gate; up]
        edit_tensors(src, lambda t: t.update({k: torch.cat(v.chunk(2, dim=1)[::-1], dim=1) for k, v in t.items()
                                              if k.endswith("mlp.experts.gate_up_proj")}))
    return hf_to_megatron(src, tmp_path / f"m4-m-no-{piece}", tp=2, pp=2, ep=2, progress=False)


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py: the text model as
    per-rank torch files, the wrapper's language model as torch_dist (its reference the wrapper as transformers
    reads it), then one guard per piece, which must be far off HF's logits; and how many must match."""
    pairs = [(models[TEXT], hf_to_megatron(models[TEXT], tmp_path / "m4-torch", tp=2, pp=2, ep=2, fmt="torch",
                                           progress=False)),
             (models[VL], hf_to_megatron(models[VL], tmp_path / "m4-vl-dist", tp=2, pp=2, ep=2, fmt="torch_dist",
                                         progress=False))]
    return pairs + [(models[TEXT], _dropped(models, tmp_path, piece)) for piece in GUARDS], len(pairs)


def assert_guards_fail(reports) -> None:
    glm4_moe_guards_fail(reports, GUARDS)


def test_a_spec_without_the_rotary_share_is_not_deepseek_v3s():
    """DeepSeek-V3's config class sets head_dim to qk_rope_head_dim (no partial rotary); Mistral 4's to
    qk_nope + qk_rope with partial_rotary_factor their ratio: both rotate qk_rope_head_dim dimensions, read as
    rotary_percent 1 of megatron-core's qk_pos_emb_head_dim. A Mistral 4 config read as DeepSeek-V3's family
    would be refused on that factor."""
    cfg = make_config(TEXT).to_dict()
    assert cfg["head_dim"] == 24 and cfg["rope_parameters"]["partial_rotary_factor"] == 8 / 24
    with pytest.raises(ConversionError, match="partial_rotary_factor=0.333.* is not supported for deepseek_v3"):
        spec_from_config({**cfg, "model_type": "deepseek_v3"})


def test_published_size_counts_as_hf_builds_it():
    """`toolkit memory`'s parameter counts of Mistral Small 4's language model at its published sizes equal HF's
    Mistral4ForCausalLM built on the meta device from that text_config: 119B total as the card says ("119B total
    parameters", 118.97B); active, the 4 routed of 128 experts and the shared one, 6.63B with the embedding and output
    layer (the architecture gallery's 6.63B), 5.56B without (the card's "6B active parameters per token")."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import active_params, total_params

    name = "mistral-small-4-119b-2603"
    published, original = corpus.config(name), corpus.index()[name]["original_sizes"]["text_config"]
    text = {**published["text_config"], **{k: v for k, v in original.items() if "." not in k}}
    text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": original["rope_parameters.partial_rotary_factor"]}
    cfg = corpus.language_config({**published, "text_config": text})
    spec = spec_from_config(cfg)[1]
    config = transformers.Mistral4Config.from_dict(cfg)
    with torch.device("meta"):
        model = transformers.Mistral4ForCausalLM(config)
    hf_total = sum(p.numel() for p in model.parameters())
    hf_active = sum(p.numel() * (config.num_experts_per_tok / config.n_routed_experts if ".mlp.experts." in n else 1)
                    for n, p in model.named_parameters())
    assert (total_params(spec), active_params(spec)) == (hf_total, int(hf_active))
    embeddings = 2 * spec.vocab_size * spec.hidden_size
    print(f"Mistral Small 4: {hf_total / 1e9:.2f}B total, {hf_active / 1e9:.2f}B active "
          f"({(hf_active - embeddings) / 1e9:.2f}B without the embedding and output layer)")
    assert round(hf_total / 1e9) == 119 and round(hf_active / 1e9, 2) == 6.63 and round((hf_active - embeddings) / 1e9) == 6


@pytest.mark.multiprocess
def test_tp2_pp2_ep2_fine_tune_matches_hf_and_routes_every_token_as_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 with EP2 (8 ranks, sequence parallel) on the tiny fp32 Mistral 4 with every
    feature on (low-rank query, YaRN with mscale / mscale_all_dim, the Llama-4 query scale within its bound, a
    dense first layer, 8 experts top-3 renormalised with routed scaling 1.5, 2 shared experts, fused experts), on
    megatron-core's local layer spec: HF's losses and gradient norms over 10 steps, every step's tokens per expert
    as HF's routers chose them, and the export loads in transformers with the experts fused again. Guards: the
    reference without the routed scaling, or without renormalisation, is far off the run."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import family_finetune_parity, routed_per_document
    from tests.test_convert_roundtrip import load_all
    from toolkit.families.hf_values import auto_causal_lm

    reference = routed_per_document()
    run = family_finetune_parity(tmp_path, TEXT, 8, FINE_TUNE_LAYOUT, lambda hf: reference, export_hf=True,
                                 layer_spec="local", seed=174)
    print(f"Mistral 4 TP2xPP2xDP2 EP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == reference.routing
    assert len(reference.routing[0]) == 3
    exported = load_all(tmp_path / "run" / "hf")
    assert set(exported) == set(load_all(run.hf)) and any(k.endswith("mlp.experts.gate_up_proj") for k in exported)
    assert type(auto_causal_lm().from_pretrained(tmp_path / "run" / "hf")).__name__ == "Mistral4ForCausalLM"

    for piece, change in (("routed scaling", {"routed_scaling_factor": 1.0}), ("renormalisation", {"norm_topk_prob": False})):
        guard = shutil.copytree(run.hf, tmp_path / f"hf-no-{piece.replace(' ', '-')}")
        edit_config(guard, **change)
        off = differences(run.metrics, *hf_reference(guard, run.data, run.cfg, STEPS))
        print(f"guard, HF without the {piece}: {off[0]:.1e} / {off[1]:.1e}")
        assert off[0] > 100 * LOSS_TOLERANCE_FP32, piece


def test_lora_on_the_fused_experts_keeps_transformers_gate_up_order():
    """PEFT's LoRA on `mlp.experts.gate_up_proj` (target_parameters) adds B's rows to megatron-core's [gate; up]
    rows as they are for Mistral 4's fused experts (FUSED_HALVES) (transformers 5's module layout, as every MoE family's),
    and de-interleaves them only for gpt-oss's. Found by the LoRA-vs-PEFT run at DP2 x EP2 (before: Mistral 4's
    rows were de-interleaved as gpt-oss's, and its first step already routed otherwise than PEFT's; after: losses
    within 9.0e-7 of PEFT's, gradient norms 2.1e-7, PeftModel on the exported adapter 7.7e-7 off the reference's
    logits, --merge equal to merge_and_unload; not a CI launch, see docs/frontier_families.md)."""
    from toolkit.families import family_named
    from toolkit.lora.experts import resolve

    for variant, family, interleaved in ((TEXT, "mistral4", False), ("gpt-oss", "gpt_oss", True)):
        spec = spec_from_config(make_config(variant).to_dict())[1]
        gate_up, down = resolve(family_named(family), spec, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], 0.0)
        assert (gate_up.interleaved, down.interleaved) == (interleaved, False), variant
        rows = gate_up.positions()
        assert torch.equal(rows, torch.arange(2 * spec.moe_ffn_hidden_size)) != interleaved, variant
