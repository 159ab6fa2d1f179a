"""Llama 4 (llama4_text; published as the wrapper llama4, Llama4ForConditionalGeneration): MoE interleaved with dense
layers (sigmoid top-1 router applied to the expert input, a shared expert), NoPE layers, the weightless L2 q/k norm on
the RoPE layers, interleaved RoPE, experts fused as x @ W halves, chunked attention and the NoPE temperature exact up
to min(attention_chunk_size, floor_scale - 1) tokens (toolkit/families/llama4.py).

HF is the reference: the text model (torch) and the wrapper's language model (torch_dist) verify at TP2 x PP2 x EP2 in
the one launch of tests/test_published_parity.py; the guards are HF-side here, single-process: each piece switched
off (or laid out otherwise) in HF's own model moves its logits more than 100 x the parity tolerance, so a
conversion that dropped it could not pass that launch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import text_and_wrapper_models
from tests.test_convert_bad_input import convert_fails, edit_config, edit_tensors
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.tinymodels import make_config, make_tiny_llama4_multimodal, make_tiny_model

TEXT, VL = "llama4", "vl"
LM = "language_model."
BOUND = 63  # min(attention_chunk_size 64, floor_scale 64 - 1)


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory):
    """The text model and the wrapper, fp32 (parity) and `-bf16` (round trips), each seeded on its own."""
    return text_and_wrapper_models(tmp_path_factory.mktemp("llama4"), TEXT, make_tiny_llama4_multimodal, 180, VL)


def test_settings_map_each_piece_to_megatron_core():
    spec = spec_from_config(make_config(TEXT).to_dict())[1]
    s = settings_for(spec).transformer
    assert {k: s.get(k) for k in ("rotary_interleaved", "moe_apply_probs_on_input", "qk_l2_norm", "qk_layernorm",
                                  "no_rope_freq", "moe_layer_freq", "moe_router_score_function", "moe_router_topk",
                                  "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                                  "moe_shared_expert_gate", "moe_ffn_hidden_size", "ffn_hidden_size")} == {
        "rotary_interleaved": True, "moe_apply_probs_on_input": True, "qk_l2_norm": True, "qk_layernorm": None,
        "no_rope_freq": [0, 0, 1, 0], "moe_layer_freq": [0, 1, 0, 1], "moe_router_score_function": "sigmoid",
        "moe_router_topk": 1, "moe_router_enable_expert_bias": False, "moe_shared_expert_intermediate_size": 24,
        "moe_shared_expert_gate": False, "moe_ffn_hidden_size": 24, "ffn_hidden_size": 48}
    assert spec.exact_seq_len == BOUND
    assert spec_from_config(make_config(TEXT, attn_temperature_tuning=False).to_dict())[1].exact_seq_len == 64
    assert spec_from_config(make_config(TEXT, attention_chunk_size=None, attn_temperature_tuning=False).to_dict()
                            )[1].exact_seq_len is None
    assert spec_from_config(make_config(TEXT, use_qk_norm=False).to_dict())[1].qk_l2_norm is False


REFUSALS = (
    ({"num_experts_per_tok": 2}, "llama4 with num_experts_per_tok=2 cannot be mapped exactly to megatron-core: HF "
                                 "scales each chosen expert's input"),
    ({"attention_bias": True}, "llama4 with attention_bias=True cannot be mapped exactly to megatron-core"),
    # Scout-Instruct's llama3 RoPE as public tests quote it
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
     "llama3 rope scaling with high_freq_factor=1.0 is not supported"),
    # transformers 4.51's files wrote 4; transformers 5's strict Llama4TextConfig types it bool
    ({"attn_temperature_tuning": 4}, "is refused by transformers' Llama4TextConfig: Validation error for field "
                                     "'attn_temperature_tuning'"),
)


def test_what_megatron_core_computes_otherwise_is_refused_in_one_line(tmp_path):
    src = make_tiny_model(TEXT, tmp_path / "src", seed=1)
    published = json.loads((src / "config.json").read_text())
    for changes, line in REFUSALS:
        edit_config(src, **changes)
        convert_fails(src, tmp_path / "out", line)
        (src / "config.json").write_text(json.dumps(published))
    wrapper = make_tiny_llama4_multimodal(tmp_path / "vl", seed=2)
    edit_config(wrapper, quantization_config={"quant_method": "fbgemm_fp8"})
    convert_fails(wrapper, tmp_path / "out", "a quantized llama4 checkpoint .quantization_config.quant_method="
                  "'fbgemm_fp8'. is not read")


def test_training_and_verifying_past_the_exact_length_are_refused_in_one_line(tiny_llama4, tmp_path):
    """The recipe refuses data.seq_len past 63 (8191 as published), where a chunk boundary or the NoPE temperature
    would apply, and `verify` a --seq-len past it, each in one line; at the bound the recipe starts."""
    from tests.finetune_harness import recipe, recipe_prepare, write_uneven_data
    from toolkit.convert.parity import verify_many
    from toolkit.errors import ToolkitError

    converted = hf_to_megatron(tiny_llama4[f"{TEXT}-bf16"], tmp_path / "m", progress=False)
    data = write_uneven_data(tmp_path / "data.jsonl", 40)
    with pytest.raises(ToolkitError, match=f"data.seq_len {BOUND + 1} exceeds {BOUND}, the longest sequence llama4 "
                                           "trains exactly"):
        recipe_prepare()(str(recipe(tmp_path, converted, data, data__seq_len=BOUND + 1)), [])
    assert recipe_prepare()(str(recipe(tmp_path, converted, data, data__seq_len=BOUND)), []).meta.model_spec.family == TEXT
    with pytest.raises(ToolkitError, match=f"--seq-len {BOUND + 1} exceeds {BOUND}, the longest sequence llama4 "
                                           "converts exactly for"):
        verify_many([(tiny_llama4[f"{TEXT}-bf16"], converted)], seq_len=BOUND + 1)


def _model(src, **config):
    from transformers import Llama4ForCausalLM

    return Llama4ForCausalLM.from_pretrained(src, dtype=torch.float32, **config).eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def _tokens(length: int):
    return torch.randint(0, 251, (2, length), generator=torch.Generator().manual_seed(0))


def test_chunks_and_the_nope_temperature_are_exact_up_to_the_bound_and_move_the_logits_past_it(tiny_llama4):
    """Within one chunk (64 tokens) HF's chunked mask is the causal one, and the NoPE layers' temperature
    log1p(floor((position + 1) / 64)) * 0.1 + 1 is exactly 1 on the first 63 positions: with or without each,
    HF's logits are the same bit for bit there (what the conversion and the recipe rely on); past the bound each
    moves them far more than the parity tolerance (why longer sequences are refused)."""
    src, tokens = tiny_llama4[TEXT], _tokens(160)
    full = _logits(_model(src), tokens)
    for change in ({"attn_temperature_tuning": False}, {"attention_chunk_size": 100_000}):
        other = _logits(_model(src, **change), tokens)
        assert torch.equal(full[:, :BOUND], other[:, :BOUND]), change
        moved = float((full[:, BOUND:] - other[:, BOUND:]).abs().max())
        print(f"{change} past {BOUND} positions: max |dlogit| {moved:.2e}")
        assert moved > 100 * FP32_TOLERANCE, change


def _halves_rope(xq, xk, freqs_cis):
    """RoPE on [first half; second half] pairs (Llama's rotate_half), not HF Llama 4's (2i, 2i + 1)."""
    cos, sin = freqs_cis.real[:, :, None, :], freqs_cis.imag[:, :, None, :]

    def rot(x):
        a, b = x.float().chunk(2, dim=-1)
        c, s = cos.repeat(1, 1, 1, 1), sin
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).type_as(x)

    return rot(xq), rot(xk)


def _moe_probs_on_output(self, hidden_states):
    """Llama4TextMoe with the router's weight on each expert's output (megatron-core's default), not its input."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden_states)
    routed = self.experts(hidden_states.repeat(scores.shape[1], 1))
    routed = routed * scores.transpose(0, 1).reshape(-1, 1)
    out = self.shared_expert(hidden_states)
    out.add_(routed.reshape(scores.shape[1], -1, routed.shape[-1]).sum(dim=0))
    return out, logits


GUARDS = ("qk-l2-norm", "qk-l2-norm-on-nope-layers", "nope-layers", "rope-halves", "probs-on-output",
          "gate-up-interleaved", "shared-expert")


def _guarded(src, piece, tmp_path, monkeypatch):
    from transformers.models.llama4 import modeling_llama4 as hf

    if piece == "qk-l2-norm":
        return _model(src, use_qk_norm=False)
    if piece == "nope-layers":
        return _model(src, no_rope_layers=[1, 1, 1, 1])
    if piece == "rope-halves":
        monkeypatch.setattr(hf, "apply_rotary_emb", _halves_rope)
        return _model(src)
    if piece == "probs-on-output":
        monkeypatch.setattr(hf.Llama4TextMoe, "forward", _moe_probs_on_output)
        return _model(src)
    if piece == "gate-up-interleaved":  # the fused [gate | up] read as gpt-oss's interleaved columns
        copy = shutil.copytree(src, tmp_path / piece)
        edit_tensors(copy, lambda t: t.update({k: torch.cat((v[..., 0::2], v[..., 1::2]), dim=-1)
                                               for k, v in t.items() if k.endswith("experts.gate_up_proj")}))
        return _model(copy)
    model = _model(src)
    if piece == "shared-expert":
        for layer in model.model.layers:
            if layer.is_moe_layer:
                torch.nn.init.zeros_(layer.feed_forward.shared_expert.down_proj.weight)
    else:  # the L2 norm on the NoPE layer too
        for layer in model.model.layers:
            if not layer.self_attn.use_rope:
                layer.self_attn.qk_norm = hf.Llama4TextL2Norm(model.config.rms_norm_eps)
    return model


@pytest.mark.parametrize("piece", GUARDS)
def test_each_piece_moves_hfs_logits_past_the_parity_tolerance(tiny_llama4, tmp_path, monkeypatch, piece):
    src, tokens = tiny_llama4[TEXT], _tokens(32)
    base = _logits(_model(src), tokens)
    moved = float((_logits(_guarded(src, piece, tmp_path, monkeypatch), tokens) - base).abs().max())
    print(f"guard {piece}: max |dlogit| {moved:.2e}")
    assert moved > 100 * FP32_TOLERANCE, piece


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_round_trips_bit_exactly(tiny_llama4, tmp_path, fmt):
    """bf16 at TP2 x PP2 x EP2: the fused experts come back fused, byte for byte, and load in transformers."""
    from toolkit.families.hf_values import auto_causal_lm

    src = tiny_llama4[f"{TEXT}-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "back", progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert any(n.endswith("feed_forward.experts.gate_up_proj") for n in tensor_hashes(src))
    assert type(auto_causal_lm().from_pretrained(back)).__name__ == "Llama4ForCausalLM"


def test_wrapper_round_trip_keeps_every_byte_and_loads_as_the_multimodal_class(tiny_llama4, tmp_path):
    """Converted from the wrapper's files (language_model.model.*, language_model.lm_head, the fused experts read
    under the wrapper's names), exported back into it: every tensor (vision model, projector, language model)
    byte-identical, the config untouched, loaded by Llama4ForConditionalGeneration; exported alone, the language
    model as Llama4ForCausalLM with the same bytes under the text model's names."""
    import transformers

    src = tiny_llama4[f"{VL}-bf16"]
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2, fmt="torch_dist", progress=False)
    assert CheckpointMeta.read(out).model_spec.family == "llama4"
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    original = tensor_hashes(src)
    assert tensor_hashes(back) == original and (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert any(n.startswith("vision_model.") for n in original) and any(n.startswith("multi_modal_projector.") for n in original)
    assert type(transformers.Llama4ForConditionalGeneration.from_pretrained(back)).__name__ == \
        "Llama4ForConditionalGeneration"
    text = megatron_to_hf(out, tmp_path / "text", progress=False)
    assert tensor_hashes(text) == {n[len(LM):]: h for n, h in original.items() if n.startswith(LM)}
    assert json.loads((text / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py: the text model as
    per-rank torch files, the wrapper's language model as torch_dist; all must match."""
    pairs = [(models[TEXT], hf_to_megatron(models[TEXT], tmp_path / "l4-torch", tp=2, pp=2, ep=2, fmt="torch",
                                           progress=False)),
             (models[VL], hf_to_megatron(models[VL], tmp_path / "l4-vl-dist", tp=2, pp=2, ep=2, fmt="torch_dist",
                                         progress=False))]
    return pairs, len(pairs)


def test_published_sizes_count_as_hf_builds_them():
    """`toolkit memory`'s parameter counts of Scout's and Maverick's language models at their published sizes equal
    HF's Llama4ForCausalLM built on the meta device from that text_config (107.8B / 400.7B total as transformers
    builds them; the cards' 17B active)."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import active_params, total_params

    for name in ("llama-4-scout-17b-16e", "llama-4-maverick-17b-128e"):
        published, original = corpus.config(name), corpus.index()[name]["original_sizes"]["text_config"]
        text = {**published["text_config"], **{k: v for k, v in original.items()
                                               if k not in ("moe_layers", "no_rope_layers")
                                               and not k.endswith("token_id")}}
        text.pop("moe_layers", None), text.pop("no_rope_layers", None)
        cfg = corpus.language_config({**published, "text_config": text})
        spec = spec_from_config(cfg)[1]
        config = transformers.Llama4TextConfig.from_dict(cfg)
        with torch.device("meta"):
            model = transformers.Llama4ForCausalLM(config)
        hf_total = sum(p.numel() for p in model.parameters())
        hf_active = sum(p.numel() * (1 / config.num_local_experts if ".experts." in n else 1)
                        for n, p in model.named_parameters())
        print(f"{name}: {hf_total / 1e9:.2f}B total, {hf_active / 1e9:.2f}B active")
        assert (total_params(spec), active_params(spec)) == (hf_total, int(hf_active)), name
        assert round(hf_active / 1e9) == 17, name


@pytest.mark.multiprocess
def test_tp2_dp2_ep2_fine_tune_matches_hf_and_routes_every_token_as_hf(tmp_path):
    """The recipe at TP2 x DP2 x EP2 with sequence parallelism (4 ranks) on the tiny fp32 Llama 4 with every piece
    on (MoE on layers 1 and 3 with the shared expert, the sigmoid top-1 router scaling the experts' input, NoPE on
    layer 2, the L2 q/k norm, chunks and the NoPE temperature beyond the recipe's sequences): HF's losses and
    gradient norms over 10 steps, every step's tokens per expert as HF's routers chose them, and the export loads
    in transformers as Llama4ForCausalLM. Guard: the reference with the q/k norm off is far off the run."""
    from tests.finetune_harness import GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import family_finetune_parity, routed_per_document
    from toolkit.families.hf_values import auto_causal_lm

    reference = routed_per_document()
    run = family_finetune_parity(tmp_path, TEXT, 4, {"tp": 2, "ep": 2, "sequence_parallel": True},
                                 lambda hf: reference, export_hf=True)
    print(f"Llama 4 TP2xDP2xEP2: max |loss - HF| {run.loss:.1e}, grad norm relative {run.norm:.1e}")
    assert len(run.metrics) == STEPS and run.loss < LOSS_TOLERANCE_FP32 and run.norm < GRAD_NORM_TOLERANCE, \
        (run.loss, run.norm)
    assert [[layer for layer in m["tokens_per_expert"] if any(layer)] for m in run.metrics] == reference.routing
    assert len(reference.routing[0]) == 2  # the two MoE layers
    assert type(auto_causal_lm().from_pretrained(tmp_path / "run" / "hf")).__name__ == "Llama4ForCausalLM"

    guard = shutil.copytree(run.hf, tmp_path / "hf-no-qk-norm")
    edit_config(guard, use_qk_norm=False)
    off = differences(run.metrics, *hf_reference(guard, run.data, run.cfg, STEPS))
    print(f"guard, HF without the q/k norm: {off[0]:.1e} / {off[1]:.1e}")
    assert off[0] > 100 * LOSS_TOLERANCE_FP32
