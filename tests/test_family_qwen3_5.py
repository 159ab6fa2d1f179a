"""Qwen3.5 / 3.6 (qwen3_5_text, qwen3_5_moe_text; published as the wrappers qwen3_5 / qwen3_5_moe):
Qwen3-Next's layers with Qwen3.5's four in_proj_* Linears, MRoPE on the attention layers, dense MLPs or
every layer MoE (toolkit/families/qwen3_5.py).

HF is the reference: megatron-core loading our checkpoints at TP2 x PP2 (dense) and TP2 x PP2 x EP2 (MoE),
both formats, and the wrappers' language models, gives HF's logits within 1e-4 in fp32, in the one launch
of tests/test_published_parity.py (the published configs: tests/test_published_configs.py's). Each new
piece has a guard here: the piece dropped or done Qwen3-Next's way moves HF's own logits far past that
tolerance, so a conversion without it fails the parity check.

The MRoPE finding: for text the three position streams are equal and Qwen3_5TextRotaryEmbedding's
interleaving copies values already there, so it is plain (partial, rotate-half) RoPE bit for bit,
whatever mrope_section says; with unequal streams it is not (the tiny model's sections give H and W a
frequency each), so the parity launch proves the reduction, not an inert MRoPE.

Fused experts: transformers 5.24's Qwen3_5MoeExperts holds `mlp.experts.gate_up_proj` [E, 2 x ffn, hidden]
([gate; up] halves, nn.functional.linear) and `down_proj` [E, hidden, ffn]; its conversion mapping loads
per-expert files too and saves per expert. Checkpoints holding the fused tensors (text, or under
`model.language_model.` in the wrappers) are written here from the per-expert ones by stacking, loaded by
transformers to the same parameters and logits, converted (FusedExperts layout FUSED_HALVES), verified in the
parity launch, and exported per expert as transformers saves them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.moe_reference import routers_without_renormalising
from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_convert_roundtrip import load_all
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config
from toolkit.megatron_settings import settings_for
from toolkit.splits import Split
from toolkit.splits.kinds import Geometry
from toolkit.tinymodels import make_config, make_tiny_model, make_tiny_qwen3_5_multimodal

DENSE, MOE = "qwen3.5", "qwen3.5-moe"
LM = "model.language_model."


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    """The text models (fp32 for parity, `-bf16` for round trips) and the wrappers (`vl`, `vl-moe`, and
    `-bf16`), each seeded on its own."""
    root = tmp_path_factory.mktemp("qwen3.5")
    models = {}
    for i, v in enumerate((DENSE, MOE)):
        models[v] = make_tiny_model(v, root / v, seed=120 + i)
        models[f"{v}-bf16"] = make_tiny_model(v, root / f"{v}-bf16", dtype="bfloat16", seed=130 + i)
    for i, (name, moe) in enumerate((("vl", False), ("vl-moe", True))):
        models[name] = make_tiny_qwen3_5_multimodal(root / name, seed=140 + i, moe=moe)
        models[f"{name}-bf16"] = make_tiny_qwen3_5_multimodal(root / f"{name}-bf16", "bfloat16", seed=150 + i, moe=moe)
    for name in (MOE, f"{MOE}-bf16", "vl-moe", "vl-moe-bf16"):  # the same models with their experts stored fused
        models[f"{name}-fused"] = fuse_as_transformers_holds_them(models[name], root / f"{name}-fused")
    return models


def fuse_as_transformers_holds_them(src, dst):
    """`dst`: `src` (a per-expert Qwen3.5-MoE checkpoint, text or wrapper) with each layer's experts as
    Qwen3_5MoeExperts' parameters: gate_up_proj [E, 2 x ffn, hidden] = each expert's [gate_proj; up_proj]
    stacked (nn.functional.linear then .chunk(2, dim=-1) gives gate, up), down_proj [E, hidden, ffn] = each
    expert's down_proj stacked."""
    import re

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = load_all(dst)
    per_expert = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    layers: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in tensors if per_expert.match(n)]:
        prefix, expert, part = per_expert.match(name).groups()
        layers.setdefault(prefix, {})[(int(expert), part)] = tensors.pop(name)
    assert layers
    for prefix, parts in layers.items():
        experts = range(len(parts) // 3)
        tensors[prefix + "gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                        for e in experts])
        tensors[prefix + "down_proj"] = torch.stack([parts[(e, "down_proj")] for e in experts])
    for f in list(dst.glob("*.safetensors")) + list(dst.glob("*.safetensors.index.json")):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 x EP2 launch of tests/test_published_parity.py (the dense
    ones at EP 1, the EP ranks then data-parallel): each text model in both formats, each wrapper's language
    model (its reference the wrapper checkpoint as transformers reads it), and the MoE text model and MoE
    wrapper with their experts stored fused (one in each format, HF's reference loading the fused file); all
    must match."""
    pairs = []
    for v in (DENSE, MOE):
        for fmt in ("torch", "torch_dist"):
            pairs.append((models[v], hf_to_megatron(models[v], tmp_path / f"{v}-{fmt}", tp=2, pp=2,
                                                    ep=2 if v == MOE else 1, fmt=fmt, progress=False)))
    for name, ep in (("vl", 1), ("vl-moe", 2)):
        pairs.append((models[name], hf_to_megatron(models[name], tmp_path / f"qwen3.5-{name}", tp=2, pp=2, ep=ep,
                                                   progress=False)))
    for name, fmt in ((f"{MOE}-fused", "torch"), ("vl-moe-fused", "torch_dist")):  # experts stored fused
        pairs.append((models[name], hf_to_megatron(models[name], tmp_path / f"qwen3.5-{name}-{fmt}", tp=2, pp=2,
                                                   ep=2, fmt=fmt, progress=False)))
    return pairs, len(pairs)


def test_settings_and_refusals():
    dense, moe = (spec_from_config(make_config(v).to_dict())[1] for v in (DENSE, MOE))
    assert (dense.family, dense.linear_layers, dense.rotary_percent, dense.is_moe) == ("qwen3_5", "1010", 0.25, False)
    assert (moe.family, moe.moe_layers, moe.moe_renormalise, moe.moe_shared_expert_gate) == ("qwen3_5_moe", None,
                                                                                         True, True)
    t = settings_for(moe).transformer
    assert {k: t[k] for k in ("experimental_attention_variant", "linear_attention_freq", "attention_output_gate",
                              "layernorm_zero_centered_gamma", "qk_layernorm")} == {
        "experimental_attention_variant": "gated_delta_net", "linear_attention_freq": [1, 0, 1, 0],
        "attention_output_gate": True, "layernorm_zero_centered_gamma": True, "qk_layernorm": True}
    for variant, changes, line in (
            (DENSE, {"linear_num_value_heads": 3}, "each key head serves whole value heads"),
            (MOE, {"layer_types": ["linear_attention", "sliding_attention"] * 2},
             r"qwen3_5_moe with layer_types\[1\]='sliding_attention'"),
            (DENSE, {"attention_bias": True}, "qwen3_5 with attention_bias=True")):
        with pytest.raises(ConversionError, match=line):
            spec_from_config(make_config(variant, **changes).to_dict())


def test_in_proj_concatenation_splits_and_merges_back_exactly():
    """2 key heads of 3, 4 value heads of 5: in_proj_qkv [6 + 6 + 20], z [20], b [4], a [4]; per TP rank
    its chunk of each of the six parts, as megatron-core's GatedDeltaNet splits in_proj."""
    geo = Geometry(4, 2, 3, 10, 10, linear_k_heads=2, linear_v_heads=4, linear_k_dim=3, linear_v_dim=5)
    shapes = {"qkv": (32, 7), "z": (20, 7), "b": (4, 7), "a": (4, 7)}
    tensors = {n: torch.randn(*s) for n, s in shapes.items()}

    class Source:
        def read(self, name, rows=None, cols=None):
            return tensors[name]

        def shape(self, name):
            return tuple(tensors[name].shape)

    split = Split.GDN_IN_PROJ_CAT
    whole = split.build(Source(), tuple(shapes), 1, 0, geo)
    assert torch.equal(whole, torch.cat(list(tensors.values())))  # megatron-core's [q; k; v; z; beta; alpha]
    shards = [split.build(Source(), tuple(shapes), 2, r, geo) for r in range(2)]
    q, k, v = tensors["qkv"].split([6, 6, 20])
    assert torch.equal(shards[1], torch.cat([q[3:], k[3:], v[10:], tensors["z"][10:], tensors["b"][2:],
                                             tensors["a"][2:]]))
    assert all(torch.equal(m, tensors[n]) for m, n in zip(split.merge(shards, geo), shapes, strict=True))


def _rope_cos_sin(config, position_ids):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rotary = Qwen3_5TextRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), position_ids)


def test_mrope_on_text_positions_is_plain_rope_bit_for_bit():
    """Qwen3_5TextRotaryEmbedding with the three streams equal (text) against megatron-core's RotaryEmbedding
    (rotary_percent 0.25, the same base): equal cos and sin, for the tiny model's mrope_section and the published
    one alike. Guard: the H stream shifted changes them (MRoPE is live: the equality is the streams')."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    seq = 40
    text = torch.arange(seq)[None, None].expand(3, 1, -1)
    for section in ([2, 1, 1], [11, 11, 10]):
        config = make_config(DENSE, rope_parameters={**make_config(DENSE).rope_parameters, "mrope_section": section})
        cos, sin = _rope_cos_sin(config, text)
        rope = RotaryEmbedding(kv_channels=config.head_dim, rotary_percent=0.25, rotary_base=10000.0,
                               use_cpu_initialization=True)
        freqs = rope.get_freqs_non_repeated(seq)  # what get_emb concatenates twice (rotate-half), off the GPU
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos[0], emb.cos()) and torch.equal(sin[0], emb.sin()), section
    shifted = text.clone()
    shifted[1] += 7
    assert not torch.equal(_rope_cos_sin(make_config(DENSE), shifted)[0], cos)


def hf_logits(src, **patches):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = reference_tokens(model.config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
    with torch.no_grad():
        if "edit" in patches:
            patches["edit"](model)
        return model(input_ids=tokens, **patches.get("inputs", {})).logits


def _as_qwen3_next_grouping(model):
    """Each in_proj_* re-laid as if the four tensors were Qwen3-Next's per-key-head groups (in_proj_qkvz,
    in_proj_ba), i.e. Split.GDN_IN_PROJ where GDN_IN_PROJ_CAT belongs."""
    config = model.config
    geo = Geometry(config.num_attention_heads, config.num_key_value_heads, config.head_dim, 1, 1,
                   linear_k_heads=config.linear_num_key_heads, linear_v_heads=config.linear_num_value_heads,
                   linear_k_dim=config.linear_key_head_dim, linear_v_dim=config.linear_value_head_dim)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            gdn = layer.linear_attn
            qkvz = torch.cat([gdn.in_proj_qkv.weight, gdn.in_proj_z.weight])
            ba = torch.cat([gdn.in_proj_b.weight, gdn.in_proj_a.weight])
            for p, w in zip((gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a),
                            Split.GDN_IN_PROJ_CAT.to_hf(Split.GDN_IN_PROJ.to_megatron([qkvz, ba], geo), geo)):
                p.weight.copy_(w)


def _router_not_renormalised(model):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    routers_without_renormalising(model, m.Qwen3_5MoeTopKRouter)


def test_guards_each_piece_moves_hf_logits_past_the_tolerance(tiny_qwen3_5):
    """HF's own model: the in_proj tensors laid out as Qwen3-Next's (what its table would convert), the MoE
    router without renormalising (norm_topk_prob's default elsewhere), and the H/W streams of MRoPE
    differing from T: each moves the logits more than 100x the parity tolerance."""
    far = 100 * FP32_TOLERANCE
    dense, moe = tiny_qwen3_5[DENSE], tiny_qwen3_5[MOE]
    base = {name: hf_logits(src) for name, src in (("dense", dense), ("moe", moe))}
    assert (hf_logits(dense, edit=_as_qwen3_next_grouping) - base["dense"]).abs().max() > far
    assert (hf_logits(moe, edit=_router_not_renormalised) - base["moe"]).abs().max() > far
    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN

    positions = torch.arange(DEFAULT_SEQ_LEN)[None, None].expand(4, DEFAULT_BATCH, -1).clone()
    assert (hf_logits(dense, inputs={"position_ids": positions}) - base["dense"]).abs().max() == 0
    positions[2:] //= 3  # the H and W streams of an image-like grid
    assert (hf_logits(dense, inputs={"position_ids": positions}) - base["dense"]).abs().max() > far


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bf16_round_trips_bit_exactly(tiny_qwen3_5, tmp_path, fmt):
    for v in (DENSE, MOE):
        src = tiny_qwen3_5[f"{v}-bf16"]
        out = hf_to_megatron(src, tmp_path / v, tp=2, pp=2, ep=2 if v == MOE else 1, fmt=fmt, progress=False)
        back = megatron_to_hf(out, tmp_path / f"{v}-back", progress=False)
        assert tensor_hashes(back) == tensor_hashes(src), v
        assert json.loads((back / "config.json").read_text())["architectures"] == [
            "Qwen3_5MoeForCausalLM" if v == MOE else "Qwen3_5ForCausalLM"]


@pytest.mark.parametrize("name", ["vl-bf16", "vl-moe-bf16"])
def test_wrapper_round_trip_keeps_every_byte_and_loads_as_the_multimodal_class(tiny_qwen3_5, tmp_path, name):
    """Converted from the wrapper's files (model.language_model.*, lm_head), exported back into it: every
    tensor (vision tower, language model) byte-identical, the config untouched, loaded by transformers'
    multimodal class; exported alone, the language model as Qwen3_5(Moe)ForCausalLM with the same bytes."""
    import transformers

    src = tiny_qwen3_5[name]
    moe = "moe" in name
    out = hf_to_megatron(src, tmp_path / "m", tp=2, pp=2, ep=2 if moe else 1, fmt="torch_dist", progress=False)
    assert CheckpointMeta.read(out).model_spec.family == ("qwen3_5_moe" if moe else "qwen3_5")
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    original = tensor_hashes(src)
    assert tensor_hashes(back) == original and (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert any(n.startswith("model.visual.") for n in original)
    cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(back)).__name__ == cls

    text = megatron_to_hf(out, tmp_path / "text", progress=False)
    rename = {LM: "model.", "lm_head.": "lm_head."}
    expected = {next(t + n[len(w):] for w, t in rename.items() if n.startswith(w)): h for n, h in original.items()
                if n.startswith(tuple(rename))}
    assert tensor_hashes(text) == expected
    assert type(transformers.AutoModelForCausalLM.from_pretrained(text)).__name__ == cls.replace(
        "ForConditionalGeneration", "ForCausalLM")


def test_the_multimodal_class_on_text_gives_the_text_models_logits(tiny_qwen3_5):
    """The reference `verify` reads a wrapper with (AutoModelForCausalLM: Qwen3_5ForCausalLM through
    transformers' qwen3_5_text prefix change) against the multimodal class itself, whose text-only forward
    builds its 3D positions (get_rope_index): the same logits, so either is the reference."""
    from transformers import AutoModelForImageTextToText

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN, reference_tokens

    for name in ("vl", "vl-moe"):
        src = tiny_qwen3_5[name]
        wrapper = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
        tokens = reference_tokens(wrapper.config.text_config.vocab_size, DEFAULT_BATCH, DEFAULT_SEQ_LEN)
        with torch.no_grad():
            assert torch.allclose(wrapper(input_ids=tokens).logits, hf_logits(src), rtol=0, atol=1e-6), name


def test_tied_wrapper_reads_tying_from_its_own_config(tiny_qwen3_5, tmp_path):
    """Qwen3_5ForConditionalGeneration ties as its top-level tie_word_embeddings says; its save_pretrained
    writes text_config.tie_word_embeddings false beside a top-level true (Qwen3.5-0.8B, 2B, 4B are tied)."""
    src = make_tiny_qwen3_5_multimodal(tmp_path / "tied", "bfloat16", seed=160, tie_word_embeddings=True)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    cfg["text_config"]["tie_word_embeddings"] = False  # as transformers' own save of a tied wrapper writes it
    (src / "config.json").write_text(json.dumps(cfg))
    out = hf_to_megatron(src, tmp_path / "m", progress=False)
    assert CheckpointMeta.read(out).model_spec.tied_embeddings is True
    assert tensor_hashes(megatron_to_hf(out, tmp_path / "back", wrapper=src, progress=False)) == tensor_hashes(src)


def test_mtp_layers_of_a_text_checkpoint_are_left_out(tiny_qwen3_5, tmp_path):
    """The published files hold a multi-token-prediction layer (`mtp.*`), which Qwen3_5ForCausalLM ignores on
    load: left out of the conversion of a text checkpoint (kept, as every non-language tensor, in a wrapper's)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_qwen3_5[f"{DENSE}-bf16"], src)
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": torch.ones(4, 4, dtype=torch.bfloat16)}, src / "model.safetensors",
              metadata={"format": "pt"})
    back = megatron_to_hf(hf_to_megatron(src, tmp_path / "m", progress=False), tmp_path / "back", progress=False)
    assert set(load_all(back)) == set(tensors)


# ---- experts stored fused (Qwen3_5MoeExperts' own tensors) ----

def _experts_modules(model):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    return [m for m in model.modules() if isinstance(m, Qwen3_5MoeExperts)]


def test_fused_files_load_in_transformers_as_the_per_expert_ones(tiny_qwen3_5):
    """Qwen3_5MoeForCausalLM (the text file, and the wrapper's language model through transformers' prefix change)
    and Qwen3_5MoeForConditionalGeneration load the fused files to the parameters they load from the per-expert
    ones, bit for bit (the fused tensors written here are the class's own), so to the same logits."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for name, auto in ((MOE, AutoModelForCausalLM), ("vl-moe", AutoModelForCausalLM),
                       ("vl-moe", AutoModelForImageTextToText)):
        per, fused = (auto.from_pretrained(tiny_qwen3_5[n], dtype=torch.float32).state_dict()
                      for n in (name, f"{name}-fused"))
        assert per.keys() == fused.keys() and all(torch.equal(per[k], fused[k]) for k in per), (name, auto)
    for name in (MOE, "vl-moe"):
        assert torch.equal(hf_logits(tiny_qwen3_5[f"{name}-fused"]), hf_logits(tiny_qwen3_5[name])), name


def _halves_read_as_interleaved(model):
    """gate_up as a reader taking gate and up interleaved (gpt-oss's layout) would place it: [0::2; 1::2]."""
    for experts in _experts_modules(model):
        w = experts.gate_up_proj
        w.copy_(torch.cat([w[:, 0::2], w[:, 1::2]], dim=1))


def _read_as_x_at_w(model):
    """The fused bytes taken as gpt-oss's x @ W layout ([E, hidden, 2 x ffn], [E, ffn, hidden]) and transposed:
    what a reader that transposes every fused tensor would build."""
    for experts in _experts_modules(model):
        for w in (experts.gate_up_proj, experts.down_proj):
            e, out, inp = w.shape
            w.copy_(w.reshape(e, inp, out).transpose(1, 2).clone())


def test_guards_fused_halves_read_interleaved_or_transposed_are_far_off(tiny_qwen3_5):
    """HF's own model loaded from the fused file: its gate_up read as interleaved halves, or both fused tensors read
    as x @ W and transposed, each moves the logits more than 100x the parity tolerance; the converter reading the
    file in gpt-oss's layout (FusedExperts.layout interleaved) refuses it on its shapes, in one line."""
    from dataclasses import replace

    from toolkit.convert.fused_experts import FusedExpertsView
    from toolkit.convert.hf_source import HFCheckpoint
    from toolkit.families.qwen3_5 import QWEN3_5_MOE
    from toolkit.families.table import FUSED_INTERLEAVED

    far = 100 * FP32_TOLERANCE
    src = tiny_qwen3_5[f"{MOE}-fused"]
    base = hf_logits(src)
    offs = {name: (hf_logits(src, edit=edit) - base).abs().max().item()
            for name, edit in (("interleaved", _halves_read_as_interleaved), ("x @ W", _read_as_x_at_w))}
    print({k: f"{v:.2e}" for k, v in offs.items()})
    assert all(v > far for v in offs.values()), offs
    with pytest.raises(ConversionError, match=r"^tensor 'model\.layers\.0\.mlp\.experts\.down_proj' has shape "
                                              r"\[6, 64, 24\] but layer 0's gate_up_proj implies \[6, 32, 48\]"):
        FusedExpertsView(HFCheckpoint(src), replace(QWEN3_5_MOE.fused_experts, layout=FUSED_INTERLEAVED))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_fused_experts_convert_bit_exactly_and_export_per_expert(tiny_qwen3_5, tmp_path, fmt, monkeypatch):
    """The fused bf16 files at TP2 x PP2 x EP2: the text model's export holds the per-expert tensors transformers
    saves, byte for byte the per-expert model's, and loads as Qwen3_5MoeForCausalLM; exported into the fused
    wrapper, every tensor outside the language model keeps the wrapper's bytes, the config is untouched, the
    language model's tensors are the per-expert wrapper's, and Qwen3_5MoeForConditionalGeneration loads it.
    The fused tensors are read one expert at a time from the file, never a layer's whole."""
    import transformers

    from toolkit.convert.hf_source import HFCheckpoint

    read, fused_reads = HFCheckpoint.read, []

    def recorded(self, name, *args, **kwargs):
        tensor = read(self, name, *args, **kwargs)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            fused_reads.append(tuple(tensor.shape))
        return tensor

    monkeypatch.setattr(HFCheckpoint, "read", recorded)
    text = tiny_qwen3_5[f"{MOE}-bf16-fused"]
    out = hf_to_megatron(text, tmp_path / "m", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    monkeypatch.undo()
    assert fused_reads and {shape[0] for shape in fused_reads} == {1}, fused_reads[:3]
    back = megatron_to_hf(out, tmp_path / "back", progress=False)
    assert tensor_hashes(back) == tensor_hashes(tiny_qwen3_5[f"{MOE}-bf16"])
    assert type(transformers.AutoModelForCausalLM.from_pretrained(back)).__name__ == "Qwen3_5MoeForCausalLM"

    wrapper = tiny_qwen3_5["vl-moe-bf16-fused"]
    out = hf_to_megatron(wrapper, tmp_path / "w", tp=2, pp=2, ep=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=wrapper, progress=False)
    exported, fused = tensor_hashes(back), tensor_hashes(wrapper)
    others = {n: h for n, h in fused.items() if not n.startswith((LM, "lm_head."))}
    assert any(n.startswith("model.visual.") for n in others) and all(exported[n] == h for n, h in others.items())
    assert exported == tensor_hashes(tiny_qwen3_5["vl-moe-bf16"])
    assert (back / "config.json").read_bytes() == (wrapper / "config.json").read_bytes()
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(back)).__name__ == \
        "Qwen3_5MoeForConditionalGeneration"


def test_fused_writer_in_the_halves_layout_gives_transformers_parameters(tiny_qwen3_5):
    """toolkit.convert.fused_experts.fuse_experts in Qwen3.5's layout (for an export with export_fused) writes
    exactly the fused tensors stacked here from the per-expert ones."""
    from toolkit.convert.fused_experts import fuse_experts
    from toolkit.families.qwen3_5 import QWEN3_5_MOE

    per, fused = load_all(tiny_qwen3_5[f"{MOE}-bf16"]), load_all(tiny_qwen3_5[f"{MOE}-bf16-fused"])
    written = dict(fuse_experts(QWEN3_5_MOE.fused_experts, 6, iter(per.items())))
    assert written.keys() == fused.keys() and all(torch.equal(written[k], fused[k]) for k in fused)


def _one_line(pattern: str) -> str:
    return "^" + pattern + "$"


def test_damaged_fused_experts_are_refused_in_one_line(tiny_qwen3_5, tmp_path):
    from tests.test_convert_bad_input import convert_fails, edit_tensors

    experts = "model.layers.{}.mlp.experts."
    cases = {
        "missing": (lambda t: t.pop(experts.format(1) + "down_proj"),
                    r"layer 1's fused experts are incomplete or mixed: missing 'model\.layers\.1\.mlp\.experts\."
                    r"down_proj' \(a layer holds gate_up_proj, down_proj, without biases\)"),
        "a bias": (lambda t: t.update({experts.format(0) + "gate_up_proj_bias": torch.zeros(6, 48)}),
                   r"layer 0's fused experts are incomplete or mixed: unexpected 'model\.layers\.0\.mlp\.experts\."
                   r"gate_up_proj_bias' .*"),
        "transposed": (lambda t: t.update({experts.format(0) + "gate_up_proj":
                                           t[experts.format(0) + "gate_up_proj"].transpose(1, 2).contiguous()}),
                       r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj' has shape \[6, 64, 24\] but layer 0's "
                       r"gate_up_proj implies \[6, 48, 32\] \(experts = 6, 2 x ffn = 64, hidden = 48\)"),
        "two-d": (lambda t: t.update({experts.format(0) + "gate_up_proj": t[experts.format(0) + "gate_up_proj"][0]}),
                  r"tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[48, 64\]; layer 0's fused "
                  r"gate and up projections are \[experts, 2 x ffn, hidden\], 2 x ffn even"),
        "both": (lambda t: t.update({experts.format(0) + "0.gate_proj.weight": torch.zeros(24, 64)}),
                 r"layer 0 holds its experts both fused \('model\.layers\.0\.mlp\.experts\.gate_up_proj'\) and per "
                 r"expert \('model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'\): not a checkpoint "
                 r"transformers loads"),
    }
    for case, (damage, line) in cases.items():
        src = tmp_path / case
        shutil.copytree(tiny_qwen3_5[f"{MOE}-bf16-fused"], src)
        edit_tensors(src, damage)
        convert_fails(src, tmp_path / f"{case}-out", _one_line(line))
    # in a wrapper the file's own name is named
    src = tmp_path / "wrapper"
    shutil.copytree(tiny_qwen3_5["vl-moe-bf16-fused"], src)
    edit_tensors(src, lambda t: t.pop(LM + "layers.1.mlp.experts.gate_up_proj"))
    convert_fails(src, tmp_path / "wrapper-out", _one_line(
        r"layer 1's fused experts are incomplete or mixed: missing 'model\.language_model\.layers\.1\.mlp\.experts\."
        r"gate_up_proj' \(a layer holds gate_up_proj, down_proj, without biases\)"))


def test_lora_on_the_four_in_proj_linears_lands_on_megatron_cores_one_in_proj_rows():
    """PEFT puts one LoRA on each of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; the toolkit wraps megatron-core's
    one GatedDeltaNet.in_proj (column-parallel) with four (A, B) pairs, A whole, each B's rows added where that
    tensor's rows are. At TP 2, rank r's in_proj is [q_r; k_r; v_r; z_r; beta_r; alpha_r] (each part's r-th half,
    gated_delta_net.py's in_proj split), written out here from the part sizes: in_proj_qkv's rows of q_r, k_r, v_r,
    then z_r, b_r, a_r."""
    from toolkit.families.qwen3_5 import QWEN3_5_MOE
    from toolkit.layouts import Layout
    from toolkit.lora import targets
    from toolkit.lora.shards import placements

    spec = spec_from_config(make_config(MOE).to_dict())[1]
    names = [f"in_proj_{p}" for p in ("qkv", "z", "b", "a")]
    [linear] = targets.resolve(QWEN3_5_MOE, spec, names)
    assert (linear.module, linear.parallel, linear.chosen) == ("self_attention.in_proj", "column", tuple(names))
    qk, v, heads = 2 * 8, 4 * 12, 4  # key heads x key dim; value heads x value dim; value heads
    sizes = {"in_proj_qkv": 2 * qk + v, "in_proj_z": v, "in_proj_b": heads, "in_proj_a": heads}
    assert [(t.name, t.out_features, t.in_features) for t in linear.parts] == [(n, sizes[n], 64) for n in names]
    for rank in range(2):
        # each part (q, k, v, z, b, a) halved: the rank's rows, in its local order
        halves = [(name, start + rank * length // 2, length // 2) for name, start, length in (
            ("in_proj_qkv", 0, qk), ("in_proj_qkv", qk, qk), ("in_proj_qkv", 2 * qk, v), ("in_proj_z", 0, v),
            ("in_proj_b", 0, heads), ("in_proj_a", 0, heads))]
        expected: dict[str, list[int]] = {}
        for name, start, length in halves:
            expected.setdefault(name, []).extend(range(start, start + length))
        local = 0
        placed = placements(linear.row.split, [(t.name, t.out_features) for t in linear.parts], 2, rank,
                            Layout(2, 1).geometry(spec), 0)
        for t, where in zip(linear.parts, placed):
            rows = expected[t.name]
            assert where.hf.tolist() == rows, (rank, t.name)
            assert where.local.tolist() == list(range(local, local + len(rows))), (rank, t.name)
            local += len(rows)


# The published sizes: (corpus entry, the model card's total and active billions, truncated). Qwen3.5-0.8B:
# "0.8B" (0.75B with its tied embeddings); Qwen3.6-35B-A3B: "35B total, 3B activated" (35.95B; 3.45B with
# the embedding and output layer, 2.44B without).
PUBLISHED_SIZES = {"qwen3.5-0.8b": (0.7, None), "qwen3.6-35b-a3b": (35, 3)}


@pytest.mark.parametrize("name", PUBLISHED_SIZES)
def test_published_sizes_count_as_hf_builds_them(name):
    """`toolkit memory`'s parameter counts (toolkit.memory.params) of the published language model equal HF's
    Qwen3_5(Moe)ForCausalLM built on the meta device from the full-size text_config."""
    import transformers

    from tests import published_corpus as corpus
    from toolkit.memory.params import active_params, total_params

    published = corpus.config(name)
    original = corpus.index()[name]["original_sizes"]
    text = {**published["text_config"], **original["text_config"]}
    cfg = corpus.language_config({**published, "text_config": text})
    spec = spec_from_config(cfg)[1]
    config = transformers.CONFIG_MAPPING[text["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf_total = sum(p.numel() for p in model.parameters())
    hf_active = sum(p.numel() * (config.num_experts_per_tok / config.num_experts if ".mlp.experts." in n else 1)
                    for n, p in model.named_parameters()) if spec.is_moe else hf_total
    assert (total_params(spec), active_params(spec)) == (hf_total, int(hf_active))
    card_total, card_active = PUBLISHED_SIZES[name]
    assert round(total_params(spec) / 1e9, 1 if card_total < 1 else 0) >= card_total
    if card_active:
        assert int(active_params(spec) / 1e9) == card_active



@pytest.mark.multiprocess
def test_moe_tp2_pp2_dp2_ep2_fine_tune_matches_hf(tmp_path):
    """The recipe at TP2 x PP2 x DP2 x EP2 with sequence parallelism (TP2 x EP2 and PP2 in one launch: a gated
    delta net and an attention layer on each stage, Qwen3.5's concatenated in_proj and the gated attention's
    heads split over TP, the experts whole on each TP rank) on the tiny fp32 Qwen3.5-MoE, routers in fp64 on
    both sides and router_aux_loss_coef 0.1: HF + torch AdamW's losses and gradient norms over 10 steps, every
    step's tokens per expert as HF's routers chose them, the HF export loading as Qwen3_5MoeForCausalLM. Guard:
    the reference with its in_proj laid out Qwen3-Next's way is far off the run."""
    from transformers import AutoModelForCausalLM

    from tests.finetune_harness import LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference
    from tests.moe_reference import gated_delta_moe_parity, moe_step_loss, pad_token_id, route_in_fp64

    run = gated_delta_moe_parity(tmp_path, MOE, "Qwen3.5-MoE")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3_5MoeForCausalLM"

    def regrouped(model):
        route_in_fp64(model)
        with torch.no_grad():
            _as_qwen3_next_grouping(model)

    off = differences(run.metrics, *hf_reference(run.hf, run.data, run.cfg, STEPS,
                                                 step_loss=moe_step_loss(pad_token_id(run.hf)), prepare=regrouped))
    print(f"guard, HF with Qwen3-Next's in_proj layout: {off[0]:.1e} / {off[1]:.1e}")
    assert off[0] > 100 * LOSS_TOLERANCE_FP32
