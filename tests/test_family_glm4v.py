"""GLM-4.6V-Flash (glm46v wrapper) and GLM-4.1V-9B (glm4v wrapper): the dense glm4v_text language model
(toolkit/families/glm4v.py) inside Glm46VForConditionalGeneration / Glm4vForConditionalGeneration.

HF is the reference: the wrapper itself on text (transformers has no causal-LM class of the language model alone),
against megatron-core loading our checkpoints at TP2 x PP2 (the launch's EP ranks as data-parallel ranks): GLM-4.6V-Flash
in both formats and GLM-4.1V in one, within 1e-4 in fp32, in the one launch of tests/test_published_parity.py. Here,
single-process: the settings as transformers' config class reads them, the rotary embedding bit for bit against
megatron-core's (interleaved, partial, MRoPE on text positions), bf16 round trips of the wrappers in both formats,
the guards on HF's own model (each piece switched off moves its logits past 100x the tolerance), the published
size as HF builds it and the LoRA targets.

No published config.json of GLM-4.6V-Flash or GLM-4.1V-9B was found in the sources searched (docs/
frontier_families.md), so the published-size test reads transformers' config class defaults, which its class
documents as GLM-4.1V-9B-Thinking's (the sizes a public print of that checkpoint's config shows: ai-bot-pro/achatbot
pull request 168) and which give GLM-4.6V-Flash's published parameter count exactly."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_convert_parity import FP32_TOLERANCE
from tests.test_family_glm4v_moe import hf_logits, logits_of
from tests.test_gemma3_wrapper import tensor_hashes
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.wrapper import open_hf
from toolkit.families import spec_from_config
from toolkit.tinymodels import GLM4V, make_tiny_glm4v_multimodal

FLASH, GLM41V = "glm46v-flash", "glm41v"
GUARD = 100 * FP32_TOLERANCE


@pytest.fixture(scope="module")
def tiny_glm4v_dense(tmp_path_factory):
    """GLM-4.6V-Flash (`glm46v-flash`) and GLM-4.1V (`glm41v`), fp32 for parity and `-bf16` for round trips, each
    seeded on its own."""
    root = tmp_path_factory.mktemp("glm4v-dense")
    models = {}
    for i, name in enumerate((FLASH, GLM41V)):
        models[name] = make_tiny_glm4v_multimodal(root / name, seed=210 + i, glm46v=name == FLASH, dense=True)
        models[f"{name}-bf16"] = make_tiny_glm4v_multimodal(root / f"{name}-bf16", "bfloat16", seed=215 + i,
                                                            glm46v=name == FLASH, dense=True)
    return models


def parity_pairs(models, tmp_path) -> tuple[list, int]:
    """(hf, megatron) pairs for the TP2 x PP2 launch of tests/test_published_parity.py: GLM-4.6V-Flash in both
    formats, GLM-4.1V in one; all must match."""
    pairs = [(models[name], hf_to_megatron(models[name], tmp_path / f"{name}-{fmt}", tp=2, pp=2, fmt=fmt,
                                           progress=False))
             for name, fmt in ((FLASH, "torch"), (FLASH, "torch_dist"), (GLM41V, "torch"))]
    return pairs, len(pairs)


def _text_config(**overrides) -> dict:
    """The tiny glm4v_text config as the wrapper's language model (toolkit/convert/wrapper.py text_config)."""
    from toolkit.tinymodels import BASE

    return {**BASE, **GLM4V, "model_type": "glm4v_text", **overrides}


def test_settings_as_transformers_reads_them(tiny_glm4v_dense):
    """Both wrappers' language model read through Glm4vTextConfig: biases, half of each 16-wide head rotated,
    interleaved, the four norms (pre and post) of plain w; megatron-core's TransformerConfig gets rotary_interleaved."""
    from toolkit.megatron_settings import settings_for

    for name in (FLASH, GLM41V):
        spec = spec_from_config(open_hf(tiny_glm4v_dense[name]).config)[1]
        assert (spec.family, spec.qkv_bias, spec.rotary_percent, spec.head_dim, spec.rotary_dim, spec.num_experts,
                spec.qk_norm, spec.tied_embeddings) == ("glm4v", True, 0.5, 16, 8, 0, False, False), name
        settings = settings_for(spec)
        assert settings.transformer["rotary_interleaved"] and settings.transformer["add_qkv_bias"]
        assert settings.gpt["rotary_percent"] == 0.5
        assert not settings.transformer.get("layernorm_zero_centered_gamma")


def test_a_head_dim_the_attention_never_reads_is_refused():
    """Glm4vTextAttention's heads are hidden // heads wide; a head_dim key only its rotary embedding reads is
    accepted where equal and refused in one line where not."""
    from toolkit.errors import ConversionError

    assert spec_from_config(_text_config(head_dim=16))[1].head_dim == 16
    with pytest.raises(ConversionError, match=r"^glm4v with head_dim=32: Glm4vTextAttention's heads are [^\n]*$"):
        spec_from_config(_text_config(head_dim=32))


def _hf_rope(section, position_ids, head_dim, partial=0.5):
    from transformers import Glm4vTextConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding

    config = Glm4vTextConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial, "mrope_section": section})
    return Glm4vTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)


def test_mrope_on_text_positions_is_megatron_cores_interleaved_partial_rope_bit_for_bit(monkeypatch):
    """Glm4vTextRotaryEmbedding with the three streams equal (text) against megatron-core's RotaryEmbedding
    (rotary_percent 0.5, rotary_interleaved): equal cos and sin for the tiny model's mrope_section and the published
    one ([8, 12, 12] of head_dim 128's 32 frequencies); and HF's apply_rotary_pos_emb (rotate_half_llm on the rotated
    half, the rest passed through) equal to megatron-core's apply_rotary_pos_emb_bshd with rotary_interleaved, bit for
    bit on random q. Guards: the H stream shifted changes the angles; megatron-core without interleaving differs."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.glm4v.modeling_glm4v import apply_rotary_pos_emb

    # RotaryEmbedding.get_emb moves its frequencies to torch.cuda.current_device(), as on CPU in the launches
    # (toolkit/runtime/cpu_compat.py)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    seq = 40
    text = torch.arange(seq)[None, None].expand(3, 1, -1)
    for section, head_dim in (([2, 1, 1], 16), ([8, 12, 12], 128)):
        cos, sin = _hf_rope(section, text, head_dim)
        rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=0.5, rotary_interleaved=True, rotary_base=10000,
                               use_cpu_initialization=True)
        freqs = rope(seq)  # [seq, 1, 1, rotated dims], each frequency twice in a row
        assert torch.equal(cos[0], freqs[:, 0, 0].cos()) and torch.equal(sin[0], freqs[:, 0, 0].sin()), section
        q = torch.randn(1, 4, seq, head_dim, generator=torch.Generator().manual_seed(head_dim))
        ours = _apply_rotary_pos_emb_bshd(q.permute(2, 0, 1, 3), freqs, rotary_interleaved=True).permute(1, 2, 0, 3)
        assert torch.equal(apply_rotary_pos_emb(q, q, cos, sin)[0], ours), section
        halves = _apply_rotary_pos_emb_bshd(q.permute(2, 0, 1, 3), freqs, rotary_interleaved=False).permute(1, 2, 0, 3)
        assert not torch.allclose(halves, ours, atol=1e-3)
    shifted = text.clone()
    shifted[1] += 7
    assert not torch.equal(_hf_rope([2, 1, 1], shifted, 16)[0], _hf_rope([2, 1, 1], text, 16)[0])


def test_guards_each_piece_switched_off_moves_hf_logits_past_the_tolerance(tiny_glm4v_dense, monkeypatch):
    """HF's own GLM-4.6V-Flash wrapper with each piece the conversion maps switched off: the post-norms (either),
    the interleaving (RoPE on halves instead of pairs), the partial rotary (every dimension rotated) and the q/k/v
    biases each move the logits more than 100x the parity tolerance; explicit equal MRoPE streams move nothing."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.glm4v import modeling_glm4v

    from toolkit.convert.parity import DEFAULT_BATCH, DEFAULT_SEQ_LEN

    src = tiny_glm4v_dense[FLASH]
    base = hf_logits(src)
    positions = torch.arange(DEFAULT_SEQ_LEN)[None, None].expand(3, DEFAULT_BATCH, -1)
    assert (hf_logits(src, {"position_ids": positions}) - base).abs().max() == 0
    moved = {}

    def load(**kw):
        return AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32, **kw)

    for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
        model = load()
        for layer in model.model.language_model.layers:
            setattr(layer, norm, torch.nn.Identity())
        moved[norm] = logits_of(model)
    model = load()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    moved["q/k/v biases"] = logits_of(model)
    config = AutoConfig.from_pretrained(src)
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "partial_rotary_factor": 1.0,
                                          "mrope_section": [4, 2, 2]}  # the 8 frequencies of the whole head
    moved["partial rotary"] = hf_logits(src, config=config)
    # RoPE on halves: the module's own rotate_half (its vision tower's) on each frequency's angles laid out twice in
    # a row ([f; f]) instead of repeat_interleave'd
    recompose = modeling_glm4v.Glm4vTextRotaryEmbedding.recomposition_frequencies
    with monkeypatch.context() as patch:
        patch.setattr(modeling_glm4v, "rotate_half_llm", modeling_glm4v.rotate_half)
        patch.setattr(modeling_glm4v.Glm4vTextRotaryEmbedding, "recomposition_frequencies",
                      lambda self, f: recompose(self, f)[..., ::2].repeat(1, 1, 2))
        moved["interleaving"] = hf_logits(src)
    moved = {piece: (logits - base).abs().max().item() for piece, logits in moved.items()}
    print("glm4v guards, max |logits - HF|:", {k: f"{v:.1e}" for k, v in moved.items()})
    assert all(v > GUARD for v in moved.values()), moved


@pytest.mark.parametrize("name,fmt", [(f"{FLASH}-bf16", "torch"), (f"{FLASH}-bf16", "torch_dist"),
                                      (f"{GLM41V}-bf16", "torch_dist")])
def test_wrapper_round_trip_keeps_every_byte_and_loads_in_transformers(tiny_glm4v_dense, tmp_path, name, fmt):
    """Converted at TP2 x PP2 from the wrapper's files, exported back into it: every tensor's bytes (the vision tower's
    as they were, the language model's bit for bit in bf16) and the config as they were, loaded by the wrapper's own
    class with its logits unchanged; exported alone, under the text names with the fused gate_up_proj."""
    from transformers import AutoModelForImageTextToText

    src = tiny_glm4v_dense[name]
    out = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2, fmt=fmt, progress=False)
    back = megatron_to_hf(out, tmp_path / "wrapped", wrapper=src, progress=False)
    assert tensor_hashes(back) == tensor_hashes(src)
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    model = AutoModelForImageTextToText.from_pretrained(back, dtype=torch.float32)
    assert type(model).__name__ == ("Glm46VForConditionalGeneration" if name.startswith(FLASH)
                                    else "Glm4vForConditionalGeneration")
    assert torch.equal(logits_of(model), hf_logits(src))
    alone = megatron_to_hf(out, tmp_path / "alone", progress=False)
    names = set(tensor_hashes(alone))
    assert {"model.layers.3.mlp.gate_up_proj.weight", "model.layers.3.post_mlp_layernorm.weight",
            "model.layers.0.post_self_attn_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"} <= names
    assert not any("visual" in n for n in names)
    cfg = json.loads((alone / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("glm4v_text", ["Glm4vTextModel"])


# zai-org/GLM-4.6V-Flash's parameters as the Hub's API counts its safetensors (vision tower included), quoted by a
# public models survey (search index file 70102877713, "HF API `safetensors.total`", read 2026-09-24)
FLASH_PUBLISHED_PARAMS = 10_292_777_472


def test_published_size_counts_as_hf_builds_it():
    """`toolkit memory`'s parameter count (toolkit.memory.params) of the language model equals HF's
    Glm46VForConditionalGeneration's language model and lm_head built on the meta device from the config classes'
    defaults (Glm4vTextConfig: 40 layers of 4096, 32 heads, 2 KV heads, FFN 13696, vocab 151552, untied; documented
    as GLM-4.1V-9B-Thinking's): 9.40B; with the default vision tower the whole is GLM-4.6V-Flash's published count
    to the parameter, so these are its sizes."""
    import transformers

    from toolkit.memory.params import total_params

    text = transformers.Glm4vTextConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]})
    config = transformers.Glm46VConfig(text_config=text.to_dict())
    cfg = {**config.text_config.to_dict(), "tie_word_embeddings": config.tie_word_embeddings}
    spec = spec_from_config(cfg)[1]
    with torch.device("meta"):
        model = transformers.Glm46VForConditionalGeneration(config)
    whole = sum(p.numel() for p in model.parameters())
    hf = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    assert whole == FLASH_PUBLISHED_PARAMS
    assert (spec.num_layers, spec.hidden_size, spec.head_dim, spec.tied_embeddings) == (40, 4096, 128, False)
    assert total_params(spec) == hf and round(hf / 1e9, 2) == 9.40, (total_params(spec), hf)


def test_the_corpus_entry_has_the_published_size():
    """GLM-4.6V-Flash's corpus entry (tests/data/published_configs glm-4.6v-flash, reconstructed on these class
    defaults) at its published sizes, built as its Glm4vForConditionalGeneration on the meta device: the whole is the
    Hub's count to the parameter, the language model 9.40B as `toolkit memory` counts it."""
    from tests import published_corpus as corpus
    from toolkit.memory.params import total_params

    spec, whole, hf_total, _ = corpus.wrapper_counts("glm-4.6v-flash")
    assert whole == FLASH_PUBLISHED_PARAMS
    assert total_params(spec) == hf_total == 9_400_279_040


def test_lora_targets_resolve_to_the_wrappers_linears():
    """Every linear a PEFT target under HF's names: q/k/v_proj in the fused linear_qkv, o_proj, the one fused
    gate_up_proj (in 64, out 2 x 96) and down_proj, with their sizes."""
    from toolkit.families import family_named
    from toolkit.lora.targets import resolve

    spec = spec_from_config(_text_config())[1]
    parts = {t.name: (t.in_features, t.out_features) for lt in resolve(family_named("glm4v"), spec, ["all-linear"])
             for t in lt.parts}
    assert parts == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                     "gate_up_proj": (64, 192), "down_proj": (96, 64)}
