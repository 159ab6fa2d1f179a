"""Gemma 4 (gemma4_text; published as the wrapper gemma4, Gemma4ForConditionalGeneration): sliding and global
layers with their own head sizes, KV heads and RoPE, keys as values on the global layers, a value norm, a stored
per-layer scalar, soft-capped logits (toolkit/families/gemma4.py).

HF is the reference: megatron-core loading our checkpoints at TP2 x PP2, both formats, and the wrapper's language
model, gives HF's logits within 1e-4 in fp32, in the one launch of tests/test_published_parity.py (the published
31B's config: tests/test_published_configs.py's launch). Each new piece has a guard here: the piece dropped, or
done the way megatron-core's stock pieces would, moves HF's own logits far past that tolerance, so a conversion
without it fails the parity check."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_convert_bad_input import convert_fails
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.blocks.rope_proportional import proportional_inv_freq
from toolkit.megatron_settings import settings_for
from toolkit.splits import Split
from toolkit.splits.kinds import Geometry
from toolkit.tinymodels import make_config, make_tiny_gemma4_multimodal, make_tiny_model

TEXT, MOE = "gemma4", "gemma4-moe"
LM = "model.language_model."


@pytest.fixture(scope="module")
def tiny_gemma4(tmp_path_factory):
    """The text model (fp32 for parity, `-bf16` for round trips) and the wrapper (`vl`, `vl-bf16`)."""
    root = tmp_path_factory.mktemp("gemma4")
    return {TEXT: make_tiny_model(TEXT, root / TEXT, seed=170),
            f"{TEXT}-bf16": make_tiny_model(TEXT, root / f"{TEXT}-bf16", dtype="bfloat16", seed=171),
            MOE: make_tiny_model(MOE, root / MOE, seed=174),
            f"{MOE}-bf16": make_tiny_model(MOE, root / f"{MOE}-bf16", dtype="bfloat16", seed=175),
            "vl": make_tiny_gemma4_multimodal(root / "vl", seed=172),
            "vl-bf16": make_tiny_gemma4_multimodal(root / "vl-bf16", "bfloat16", seed=173)}


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py (the dense ones with
    the EP ranks data-parallel): the dense and the MoE text models in both formats and the wrapper's language model;
    all must match."""
    pairs = [(models[v], hf_to_megatron(models[v], tmp_path / f"{v}-{fmt}", tp=2, pp=2, ep=2 if v == MOE else 1,
                                        fmt=fmt, progress=False))
             for v in (TEXT, MOE) for fmt in ("torch", "torch_dist")]
    pairs.append((models["vl"], hf_to_megatron(models["vl"], tmp_path / "gemma4-vl", tp=2, pp=2, progress=False)))
    return pairs, len(pairs)


def test_settings_and_refusals():
    spec = spec_from_config(make_config(TEXT).to_dict())[1]
    assert (spec.family, spec.window_layers, spec.linear_layers, spec.head_dim, spec.num_kv_heads) == (
        "gemma4", "110110", "002002", 16, 4)
    assert spec.global_attention == {"head_dim": 32, "kv_heads": 2, "k_eq_v": True, "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.25}
    assert (spec.softmax_scale, spec.final_logit_softcapping, spec.window_rope_theta) == (1.0, 0.75, 1e4)
    assert not spec.is_moe
    moe = spec_from_config(make_config(MOE).to_dict())[1]
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size, moe.moe_renormalise, moe.ffn_hidden_size,
            moe.moe_layers) == (8, 2, 24, True, 96, None)
    t = settings_for(spec).transformer
    assert {k: t[k] for k in ("kv_channels", "num_query_groups", "softmax_scale", "qk_layernorm",
                              "hetereogenous_dist_checkpoint", "window_attn_skip_freq")} == {
        "kv_channels": 16, "num_query_groups": 4, "softmax_scale": 1.0, "qk_layernorm": True,
        "hetereogenous_dist_checkpoint": True, "window_attn_skip_freq": [1, 1, 0, 1, 1, 0]}
    assert "layernorm_zero_centered_gamma" not in t  # Gemma4RMSNorm applies w, not Gemma 3's 1 + w
    for changes, line in (
            ({"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input=8 cannot be mapped exactly"),
            ({"num_kv_shared_layers": 3}, "num_kv_shared_layers=3 cannot be mapped exactly"),
            ({"use_double_wide_mlp": True}, "use_double_wide_mlp=True cannot be mapped exactly"),
            ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' cannot be mapped exactly"),
            ({"attention_bias": True}, "attention_bias=True cannot be mapped exactly"),
            ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                  "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
             "rope_type='linear'")):
        with pytest.raises(ConversionError, match=line) as e:
            spec_from_config(make_config(TEXT, **changes).to_dict())
        assert "\n" not in str(e.value)
    # use_bidirectional_attention "vision" (as published): text alone is causal, so it converts
    assert spec_from_config(make_config(TEXT, use_bidirectional_attention="vision").to_dict())[1] is not None


def test_keys_as_values_refused_in_one_line_where_a_rank_would_hold_part_of_a_key_head(tiny_gemma4, tmp_path):
    convert_fails(tiny_gemma4[f"{TEXT}-bf16"], tmp_path / "m", r"^2 global key/value heads \(num_global_key_value_heads\) "
                  r"and --tp 4: the keys that are also values \(attention_k_eq_v\) need whole key heads on each rank$", tp=4)


def test_keys_as_values_split_and_merge_back_exactly():
    """2 query groups of 3 heads, head 4: [q heads of g; k_g] per group, a contiguous chunk per TP rank."""
    geo = Geometry(6, 1, 8, 10, 10, global_kv_heads=2, global_head_dim=4)
    q, k = torch.randn(24, 5), torch.randn(8, 5)
    tensors = {"q": q, "k": k}

    class Source:
        def read(self, name, rows=None, cols=None):
            return tensors[name][rows if rows is not None else slice(None)]

        def shape(self, name):
            return tuple(tensors[name].shape)

    whole = Split.GLOBAL_QK.build(Source(), ("q", "k"), 1, 0, geo)
    assert torch.equal(whole, torch.cat([q[:12], k[:4], q[12:], k[4:]]))
    shards = [Split.GLOBAL_QK.build(Source(), ("q", "k"), 2, r, geo) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([q[12:], k[4:]]))
    assert all(torch.equal(a, b) for a, b in zip(Split.GLOBAL_QK.merge(shards, geo), (q, k), strict=True))
    assert Split.GLOBAL_QK.shape([(24, 5), (8, 5)], geo, 2) == (16, 5)


def test_proportional_rope_frequencies_are_hfs_bit_for_bit():
    """The global layers' inv_freq (toolkit/blocks/rope_proportional.py) against transformers' own proportional RoPE, for the tiny
    model's head (32, a quarter rotated) and the published one (512): equal bit for bit; megatron-core's
    partial rotary (rotary_percent: the exponent over the rotated dimensions only) is not."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    for head in (32, 512):
        config = make_config(TEXT, global_head_dim=head)
        theirs = Gemma4TextRotaryEmbedding(config).full_attention_inv_freq
        ours = proportional_inv_freq(head, 1e6, 0.25)
        assert torch.equal(ours, theirs), head
        rotated = head // 8
        stock = 1.0 / (1e6 ** (torch.arange(0, 2 * rotated, 2).float() / (2 * rotated)))
        assert not torch.equal(stock, theirs[:rotated])


def hf_logits(src, edit=None, **config_change):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **config_change).eval()
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        if edit:
            edit(model)
        return model(input_ids=tokens).logits


def _attentions(model, kind=None):
    return [layer.self_attn for layer in model.model.layers if kind is None or layer.self_attn.layer_type == kind]


def _no_value_norm(model):
    for attn in _attentions(model):
        attn.v_norm = torch.nn.Identity()


def _values_after_key_norm(model):
    """The global layers' values taken from the normed keys (k_norm's weight on them), not the projection as is."""
    for attn in _attentions(model, "full_attention"):
        attn.v_norm = attn.k_norm


def _stock_partial_rotary(model):
    """The global layers' RoPE as megatron-core's rotary_percent computes it (exponent over the rotated dims)."""
    rotary = model.model.rotary_emb
    inv = rotary.full_attention_inv_freq
    angles = int((inv > 0).sum())
    stock = 1.0 / (1e6 ** (torch.arange(0, 2 * angles, 2).float() / (2 * angles)))
    rotary.full_attention_inv_freq = torch.cat([stock, inv[angles:]])


def _no_layer_scalar(model):
    for layer in model.model.layers:
        layer.layer_scalar.fill_(1.0)


def _head_dim_scaling(model):
    for attn in _attentions(model):
        attn.scaling = attn.head_dim ** -0.5


def _router_input_normed(model):
    """The router reading the experts' input (pre_feedforward_layernorm_2's output), not the residual stream."""
    for layer in model.model.layers:
        norm, router = layer.pre_feedforward_layernorm_2, layer.router
        router.forward = (lambda r, n: lambda x: type(r).forward(r, n(x)))(router, norm)


def _no_per_expert_scale(model):
    for layer in model.model.layers:
        layer.router.per_expert_scale.fill_(1.0)


def _no_router_scale(model):
    for layer in model.model.layers:
        layer.router.scale.fill_(1.0)


def _no_dense_branch(model):
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.zero_()


def test_moe_guards_each_piece_moves_hf_logits_past_the_tolerance(tiny_gemma4):
    """The MoE block's pieces, each dropped in HF's own model: the router reading the residual stream (the experts'
    normed input instead), its scale, the per-expert scale, the dense MLP beside the experts."""
    src = tiny_gemma4[MOE]
    base = hf_logits(src)
    moved = {name: (hf_logits(src, edit) - base).abs().max().item() for name, edit in (
        ("router input", _router_input_normed), ("router scale", _no_router_scale),
        ("per_expert_scale", _no_per_expert_scale), ("dense branch", _no_dense_branch))}
    assert all(d > 100 * FP32_TOLERANCE for d in moved.values()), " ".join(f"{k}: {v:.2e}" for k, v in moved.items())


def test_guards_each_piece_moves_hf_logits_past_the_tolerance(tiny_gemma4):
    """HF's own model with one piece each dropped or done megatron-core's stock way: the value norm, the
    values as the projected keys (taken after k_norm instead), the proportional RoPE (megatron-core's partial
    rotary instead; full rotation), layer_scalar, softmax scale 1 (1/sqrt(head_dim) instead), the final
    soft-cap, the sliding window: each moves the logits more than 100x the parity tolerance."""
    far = 100 * FP32_TOLERANCE
    src = tiny_gemma4[TEXT]
    base = hf_logits(src)
    full_rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    moved = {
        "v_norm": hf_logits(src, _no_value_norm),
        "k_eq_v": hf_logits(src, _values_after_key_norm),
        "stock partial rotary": hf_logits(src, _stock_partial_rotary),
        "full rotation": hf_logits(src, rope_parameters=full_rope),
        "layer_scalar": hf_logits(src, _no_layer_scalar),
        "scaling": hf_logits(src, _head_dim_scaling),
        "softcap": hf_logits(src, final_logit_softcapping=None),
        "window": hf_logits(src, sliding_window=64),
    }
    small = {name: (logits - base).abs().max().item() for name, logits in moved.items()}
    assert all(d > far for d in small.values()), " ".join(f"{k}: {v:.2e}" for k, v in small.items())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_round_trips_bit_exactly(tiny_gemma4, tmp_path, fmt):
    """The dense model, and the MoE one at EP 2 with its experts exported fused as HF stores them."""
    for v in (TEXT, MOE):
        src = tiny_gemma4[f"{v}-bf16"]
        out = hf_to_megatron(src, tmp_path / v, tp=2, pp=2, ep=2 if v == MOE else 1, fmt=fmt, progress=False)
        back = megatron_to_hf(out, tmp_path / f"{v}-back", progress=False)
        assert tensor_hashes(back) == tensor_hashes(src), v
        assert json.loads((back / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]
    assert "model.layers.0.experts.gate_up_proj" in tensor_hashes(back)


def test_wrapper_round_trip_keeps_every_byte_and_loads_as_the_multimodal_class(tiny_gemma4, tmp_path):
    """Converted from the wrapper's files (model.language_model.*), exported back into it: every tensor (vision
    tower, its projection, the language model) byte-identical, the config untouched, loaded by transformers'
    multimodal class; exported alone, the language model as Gemma4ForCausalLM with the same bytes."""
    import transformers

    src = tiny_gemma4["vl-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, fmt="torch_dist", progress=False)
    assert CheckpointMeta.read(out).model_spec.family == "gemma4"
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    original = tensor_hashes(src)
    assert tensor_hashes(back) == original and (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert any(n.startswith("model.vision_tower.") for n in original)
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(back)).__name__ == "Gemma4ForConditionalGeneration"
    text = megatron_to_hf(out, tmp_path / "text", progress=False)
    expected = {"model." + n[len(LM):]: h for n, h in original.items() if n.startswith(LM)}
    assert tensor_hashes(text) == expected
    assert type(transformers.AutoModelForCausalLM.from_pretrained(text)).__name__ == "Gemma4ForCausalLM"


# The tiny MoE's seed for the fine-tune: over the reference's 10 steps its closest top-k decision (the gap between
# the 8th and 9th router probability, in fp64) is 4.2e-7, against 9.9e-10 with the default seed, where one token of
# layer 2 went to another expert at step 6 on one machine (a last-bit difference in the fp32 router input) and
# not on another; seeds 1-13 gave 9.5e-10 to 4.2e-7.
ROUTING_SEED = 8


@pytest.mark.multiprocess
def test_moe_tp2_pp2_dp2_ep2_fine_tune_matches_hf(tmp_path):
    """The family's one fine-tune launch: the recipe at TP2 x PP2 x DP2 x EP2 with sequence parallelism (8 processes)
    on the tiny fp32 Gemma 4 MoE, 4 layers (a sliding and a global one on each stage, so the attention pieces of the
    dense 31B train here too), routers in fp64 on both sides (Gemma 4 has no load-balancing loss): HF + torch
    AdamW's losses and gradient norms over 10 steps, every step's tokens per expert as HF's routers chose them, the
    export loading as Gemma4ForCausalLM with its experts fused as HF stores them, the router's scales and a global
    layer's keys (its values too) trained, layer_scalar as stored. (The dense model's own launch at TP2 x PP2 x DP2,
    run once: losses within 6.0e-7, gradient norms 9.7e-7 relative.)"""
    from transformers import AutoModelForCausalLM

    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS
    from tests.moe_reference import family_finetune_parity, gemma4_routers_in_fp64, routed_per_document

    run = family_finetune_parity(tmp_path, MOE, 8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: routed_per_document(), moe={"router_dtype": "fp64"},
                                 prepare=gemma4_routers_in_fp64, export_hf=True, layer_spec="local", num_hidden_layers=4,
                                 layer_types=["sliding_attention", "full_attention"] * 2, seed=ROUTING_SEED)
    print(f"Gemma 4 MoE TP2xPP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == run.step_loss.routing
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "Gemma4ForCausalLM"
    original = AutoModelForCausalLM.from_pretrained(run.hf, dtype=torch.float32).state_dict()
    for name in ("model.layers.1.experts.gate_up_proj", "model.layers.1.router.scale",
                 "model.layers.1.router.per_expert_scale", "model.layers.3.self_attn.k_proj.weight"):
        assert not torch.equal(exported.state_dict()[name], original[name]), f"{name} was not trained"
    assert torch.equal(exported.state_dict()["model.layers.3.layer_scalar"], original["model.layers.3.layer_scalar"])


# The published sizes: (corpus entry, the model card's total and active billions). Gemma 4 31B: "30.7B"; 26B-A4B:
# "25.2B total, 3.8B active" (the language models alone, the vision towers of about 0.55B beside them).
PUBLISHED_SIZES = {"gemma-4-31b-it": (30.7, None), "gemma-4-26b-a4b-it": (25.2, 3.8)}


@pytest.mark.parametrize("name", PUBLISHED_SIZES)
def test_published_sizes_count_as_hf_builds_them(name):
    """`toolkit memory`'s parameter counts (toolkit.memory.params) of the published language model equal HF's
    Gemma4ForCausalLM built on the meta device from the full-size text_config (its layer_scalar buffers counted:
    the toolkit holds them as untrained parameters); the experts count k / E of themselves as active."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import active_params, total_params

    published = corpus.config(name)
    text = {**published["text_config"], **corpus.index()[name]["original_sizes"]["text_config"]}
    cfg = corpus.language_config({**published, "text_config": text})
    spec = spec_from_config(cfg)[1]
    config = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    scalars = sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    share = config.top_k_experts / config.num_experts if spec.is_moe else 1
    hf_total = sum(p.numel() for p in model.parameters()) + scalars
    hf_active = sum(p.numel() * (share if ".experts." in n else 1) for n, p in model.named_parameters()) + scalars
    assert (total_params(spec), active_params(spec)) == (hf_total, int(hf_active))
    card_total, card_active = PUBLISHED_SIZES[name]
    assert round(total_params(spec) / 1e9, 1) == card_total
    if card_active:
        assert round(active_params(spec) / 1e9, 1) == card_active


def test_lora_targets_and_what_stays_refused_on_the_moe_block():
    """Dense: every linear a PEFT target, the global layers' q/k (no v_proj where k is v) and o_proj with their own
    sizes. MoE (enable_moe_block): the attention and the dense MLP beside the experts (megatron-core's mlp.dense)
    with all-linear, the routed experts as `experts.*` target_parameters (trained against PEFT in
    tests/test_lora_moe.py); still refused in one line: the router's proj, and the experts at TP > 1."""
    from toolkit.errors import AdapterError
    from toolkit.families import family_named
    from toolkit.lora import experts
    from toolkit.lora.targets import resolve

    family = family_named("gemma4")
    spec = spec_from_config(make_config(TEXT).to_dict())[1]
    linears = {(lt.module, lt.parts, tuple(lt.layers(spec))) for lt in resolve(family, spec, ["all-linear"])}
    by_layers = {}
    for _, parts, layers in linears:
        by_layers.setdefault(layers, {}).update((t.name, (t.in_features, t.out_features)) for t in parts)
    assert by_layers[(2, 5)] == {"q_proj": (64, 256), "k_proj": (64, 64), "o_proj": (256, 64)}
    assert by_layers[(0, 1, 3, 4)] == {"q_proj": (64, 128), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (128, 64)}
    moe = spec_from_config(make_config(MOE).to_dict())[1]
    modules = {lt.module: lt.chosen for lt in resolve(family, moe, ["all-linear"])}
    assert modules["mlp.dense.linear_fc1"] == ("gate_proj", "up_proj") and modules["mlp.dense.linear_fc2"] == ("down_proj",)
    chosen = experts.resolve(family, moe, ["gate_up_proj", "down_proj"], 0.0)
    assert experts.config_names(chosen) == ["experts.gate_up_proj", "experts.down_proj"]
    with pytest.raises(AdapterError, match=r"^LoRA on the Mixture-of-Experts router \(proj\) is not supported[^\n]*$"):
        resolve(family, moe, ["q_proj", "proj"])
    with pytest.raises(AdapterError, match=r"^LoRA on the experts \(peft.target_parameters\) at parallel.tp=2 [^\n]*$"):
        experts.check_layout(2, chosen)
