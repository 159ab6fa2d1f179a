"""Published config.json files as they are (tests/published_corpus.py): read the way transformers
reads them, and each converted at TP2 x PP2 (x EP2 for Mixture-of-Experts) and verified against
the HF model in fp32, or refused in one line.

Keys a published file leaves out take transformers' class defaults, never the toolkit's: for
every family, each key of a published config is left out in turn and the spec must equal the
one read from transformers' own save_pretrained of that config (which writes every value).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import published_corpus as corpus
from tests.test_convert_bad_input import convert_fails
from toolkit.convert import hf_to_megatron
from toolkit.convert.hf_source import HFCheckpoint
from toolkit.convert.metadata import CheckpointMeta
from toolkit.errors import ConversionError
from toolkit.families import spec_from_config

FP32_TOLERANCE = 1e-4
# Longer than the corpus' windows (Gemma 3 1B's 512), so each windowed layer masks; but for
# Phi-3-mini-4k's 2047, whose logits past it would cost a launch of their own: the same window code
# is proven on a Phi-3 whose window (8) its parity sequences (32) pass.
SEQ_LEN = 520
# Gemma 3 4B/12B/27B's window (1024) is Gemma 3 1B's code with a longer window: the 1B's 512 is passed here
GEMMA3_WINDOW = "tests/test_published_configs.py (gemma-3-1b-it)"
WINDOWS_PROVEN_ELSEWHERE = {"phi-3-mini-4k-instruct": "tests/test_family_phi3.py", "gemma-3-4b-it": GEMMA3_WINDOW,
                            "gemma-3-12b-it": GEMMA3_WINDOW, "gemma-3-27b-it": GEMMA3_WINDOW,
                            "olmo-3-7b": "tests/test_family_olmo3.py", "olmo-3.1-32b-think": "tests/test_family_olmo3.py",
                            "gemma-4-31b-it": "tests/test_family_gemma4.py", "gemma-4-26b-a4b-it": "tests/test_family_gemma4.py"}
KIMI_K25 = "kimi-k2.5"
NOT_KEYS = ("model_type", "architectures", "transformers_version")
# A wrapper's sub-configs are not optional keys: each key inside text_config is left out in turn instead
# (without a text_config, transformers would build its class's default language model, which is no model published)
SUB_CONFIGS = ("text_config", "vision_config")


def outcome(cfg: dict):
    """The spec, or the refusal without the key naming that may differ by where the file put it."""
    try:
        return spec_from_config(corpus.language_config(cfg))[1]
    except ConversionError as e:
        return "refused: " + str(e).split(": ", 1)[-1]


def as_transformers_saves(cfg: dict, tmp_path: Path) -> dict | None:
    """cfg after transformers' config class read it and save_pretrained wrote it, or None when
    transformers itself refuses cfg."""
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[corpus.transformers_model_type(cfg)].from_dict(json.loads(json.dumps(cfg)))
    except Exception:  # transformers' own refusal: nothing to compare with
        return None
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_reconstructed_entries_say_what_they_were_built_from_and_what_is_unconfirmed():
    """No verbatim copy was found of these (docs/guide/published-configs.md lists them): each names its
    sources and the values they do not confirm."""
    reconstructed = {name: entry for name, entry in corpus.index().items() if entry.get("verbatim") is False}
    assert {"llama-3.3-70b-instruct", "gemma-3-4b-it", "olmoe-1b-7b-0924", "phi-3-mini-128k-instruct"} <= set(reconstructed)
    for name, entry in reconstructed.items():
        assert entry["source"] and entry["reconstructed_from"] and entry["unconfirmed"], name


@pytest.mark.parametrize("name", sorted(corpus.index()))
def test_each_key_left_out_reads_as_transformers_own_save_of_that_config(name, tmp_path):
    published = corpus.config(name)
    compared, differ = 0, []
    variants = left_out_variants(published)
    for key, left_out in variants:
        saved = as_transformers_saves(left_out, tmp_path / key)
        if saved is None:
            continue
        ours, theirs = outcome(left_out), outcome(saved)
        if ours != theirs:
            differ.append(f"without {key!r}: {_difference(ours, theirs)}")
        compared += 1
    assert not differ, f"{name}:\n" + "\n".join(differ)
    assert compared >= len(variants) // 2, "transformers refused most variants: compared too few"


def left_out_variants(published: dict) -> list[tuple[str, dict]]:
    """(the key, the config without it) for each key but NOT_KEYS; in a wrapper, each key of its text
    config too (the one the language model is read from), "text_config.KEY"."""
    variants = [(key, {k: v for k, v in published.items() if k != key})
                for key in sorted(set(published) - set(NOT_KEYS) - set(SUB_CONFIGS))]
    text = published.get("text_config")
    if isinstance(text, dict):
        variants += [(f"text_config.{key}", {**published, "text_config": {k: v for k, v in text.items() if k != key}})
                     for key in sorted(set(text) - set(NOT_KEYS))]
    return variants


def _difference(ours, theirs) -> str:
    if isinstance(ours, str) or isinstance(theirs, str):
        return f"{ours} != {theirs}"
    a, b = ours.to_dict(), theirs.to_dict()
    return ", ".join(f"{k} {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k])


# -- Gemma 3's defaults: each of these failed before config.json was read through Gemma3TextConfig --

GEMMA3 = "gemma-3-1b-it"
# What the multimodal checkpoints' text_config leaves to Gemma3TextConfig (the RoPE bases and the
# softmax scalar; the head counts too, but those would change the shrunk weights' shapes)
GEMMA3_TEXT_CONFIG_LEAVES_OUT = ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar")


def gemma3_without(*keys: str) -> dict:
    return {k: v for k, v in corpus.config(GEMMA3).items() if k not in keys}


def test_gemma3_without_rope_theta_uses_transformers_global_base_of_1e6():
    """The multimodal checkpoints' text_config leaves rope_theta out: Gemma3TextConfig's default for
    the global layers is 1e6 (the toolkit used 10,000, a silently wrong conversion)."""
    spec = spec_from_config(gemma3_without("rope_theta", "rope_local_base_freq"))[1]
    assert (spec.rope_theta, spec.window_rope_theta) == (1_000_000.0, 10_000.0)


def test_gemma3_without_query_pre_attn_scalar_uses_the_class_default():
    """Was a KeyError traceback at toolkit/families/gemma3.py:45."""
    spec = spec_from_config(gemma3_without("query_pre_attn_scalar"))[1]
    assert spec.softmax_scale == 256 ** -0.5


def test_gemma3_head_counts_left_to_the_class_defaults():
    """Gemma3TextConfig: 8 heads, 4 KV heads, head_dim 256 (the toolkit used KV heads = heads)."""
    spec = spec_from_config(gemma3_without("num_attention_heads", "num_key_value_heads", "head_dim"))[1]
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 4, 256)


def test_gemma3_wrappers_in_the_corpus_leave_their_values_to_the_class():
    """The 4B / 12B / 27B entries (reconstructed, index.json) hold the text_config as published: the
    language model the parity launch verifies takes rope_theta, head counts and the softmax scalar
    from Gemma3TextConfig (global base 1e6, 8 heads / 4 KV heads / head_dim 256, scalar 256)."""
    expected = {"gemma-3-4b-it": (8, 4, 256, 256), "gemma-3-12b-it": (4, 2, 256, 256), "gemma-3-27b-it": (4, 2, 16, 168)}
    for name, (heads, kv_heads, head_dim, scalar) in expected.items():
        published = corpus.config(name)
        assert "rope_theta" not in published["text_config"] and published["model_type"] == "gemma3"
        spec = spec_from_config(corpus.language_config(published))[1]
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (heads, kv_heads, head_dim), name
        assert (spec.rope_theta, spec.window_rope_theta, spec.softmax_scale) == (1e6, 1e4, scalar ** -0.5), name


def test_gemma3_1b_it_without_tie_word_embeddings_converts_tied(tmp_path):
    """gemma-3-1b-it has no tie_word_embeddings key; the class default is True, so its files hold no
    lm_head.weight (the toolkit assumed False and refused it for the missing tensor)."""
    assert "tie_word_embeddings" not in corpus.config(GEMMA3)
    src = corpus.build_model(GEMMA3, tmp_path / "hf")
    assert "lm_head.weight" not in HFCheckpoint(src).tensors
    out = hf_to_megatron(src, tmp_path / "m", progress=False)
    assert CheckpointMeta.read(out).model_spec.tied_embeddings is True


def test_verbose_conversion_names_the_keys_read_and_the_defaults_applied(tmp_path):
    src = corpus.build_model(GEMMA3, tmp_path / "hf")
    result = subprocess.run([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(src),
                             str(tmp_path / "m"), "--verbose", "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "read through transformers' Gemma3TextConfig" in out
    read = re.search(r"read from the file \(\d+\): (.*)", out).group(1).split(", ")
    assert {"hidden_size", "num_key_value_heads", "query_pre_attn_scalar", "sliding_window"} <= set(read)
    assert "    tie_word_embeddings = True" in out.splitlines()
    assert "tie_word_embeddings" not in read


# -- the corpus: converts and verifies exactly, or is refused in one line --

def test_every_published_config_converts_or_is_refused_in_one_line(tmp_path):
    """An entry whose outcome is not "converts" names its refusal, which conversion must give in one
    line (Kimi-K2.5 as published, its INT4 experts; LongRoPE was refused before it); an entry that converts but is not verified (index.json
    "unverified" says why) must convert at TP2 x PP2 x EP2. One test over the lists rather than a parameter
    per entry, so an empty list is not reported as a skip."""
    for name in corpus.refused():
        src = corpus.build_model(name, tmp_path / name / "hf")
        convert_fails(src, tmp_path / name / "out", r"^[^\n]*" + re.escape(corpus.index()[name]["outcome"]) + r"[^\n]*$",
                      **corpus.convert_options(name))
    for name in corpus.converting_unverified():  # DeepSeek-V3 and Kimi-K2 as published: FP8, a float32 expert bias
        src = corpus.build_model(name, tmp_path / name / "hf")
        hf_to_megatron(src, tmp_path / name / "out", tp=2, pp=2, ep=2, progress=False, **corpus.convert_options(name))


def max_positions(cfg: dict) -> int:
    """max_position_embeddings, the config class's where the file leaves it out (Gemma 3's text_config)."""
    from transformers import CONFIG_MAPPING

    return cfg.get("max_position_embeddings") or CONFIG_MAPPING[corpus.transformers_model_type(cfg)]().max_position_embeddings


def test_the_parity_sequence_passes_every_window_but_those_proven_elsewhere():
    """A window that binds (shorter than max_position_embeddings; Phi-3.5's 262144 never does) and
    that SEQ_LEN does not pass must be named, with the test that proves its semantics instead."""
    unpassed = set()
    for name in corpus.converting():
        cfg = corpus.language_config(corpus.config(name))
        window = spec_from_config(cfg)[1].window_size
        if window and SEQ_LEN <= window < max_positions(cfg):
            unpassed.add(name)
    assert unpassed == set(WINDOWS_PROVEN_ELSEWHERE)


@pytest.mark.multiprocess
def test_published_configs_convert_at_tp2_pp2_ep2_and_match_hf_logits(tmp_path):
    """One launch of 8 processes (TP2 x PP2 x EP2; the dense models run with DP 2) verifies every
    converting config of the corpus on sequences longer than its windows, and two variants of published ones."""
    from toolkit.convert.parity import verify_many

    cases = [(name, corpus.build_model(name, tmp_path / name)) for name in corpus.distinct_converting()]
    # and Gemma 3 without the keys a multimodal text_config leaves out: converted with 10,000 as
    # the global RoPE base, this was silently wrong (transformers' default is 1e6)
    cases.append((f"{GEMMA3} without {GEMMA3_TEXT_CONFIG_LEAVES_OUT}",
                  corpus.build_model(GEMMA3, tmp_path / "gemma3-defaults", leave_out=GEMMA3_TEXT_CONFIG_LEAVES_OUT)))
    # and Kimi-K2.5 less its INT4 quantization_config (refused as published): rms_norm_eps 1e-5 with the MLA latent
    # norms at HF's 1e-6, refused before for that eps (tests/test_family_kimi_k25.py)
    cases.append((f"{KIMI_K25} without its quantization_config",
                  corpus.build_model(KIMI_K25, tmp_path / "kimi-k25", sizes=corpus.unquantized_text_config(KIMI_K25))))
    pairs = []
    for i, (name, src) in enumerate(cases):
        ep = 2 if spec_from_config(corpus.language_config(json.loads((src / "config.json").read_text())))[1].is_moe else 1
        options = corpus.convert_options(name) if name in corpus.index() else {}
        pairs.append((src, hf_to_megatron(src, tmp_path / f"m{i}", tp=2, pp=2, ep=ep, progress=False, **options)))
    reports = verify_many(pairs, tp=2, pp=2, ep=2, seq_len=SEQ_LEN, batch=1, progress=False)
    for (name, _), report in zip(cases, reports):
        assert report.ok and report.max_logit_diff < FP32_TOLERANCE, name + "\n" + "\n".join(report.lines())


def hf_logits(src: Path, **config_change):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.parity import reference_tokens

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **config_change)
    with torch.no_grad():
        return model(reference_tokens(model.config.vocab_size, 1, SEQ_LEN), use_cache=False).logits


def test_gemma3_window_and_global_rope_base_change_the_logits_so_the_corpus_parity_proves_them(tmp_path):
    """Guards of the parity test above: on its 520 tokens, Gemma 3 1B's window (512) and the
    global layers' RoPE base (1e6, where the toolkit used to take 10,000) each move the logits far
    past the tolerance."""
    src = corpus.build_model(GEMMA3, tmp_path / "hf")
    logits = hf_logits(src)
    no_window = 2 * SEQ_LEN  # longer than the sequence (Gemma 3's cache refuses None)
    assert (hf_logits(src, sliding_window=no_window) - logits).abs().max() > 100 * FP32_TOLERANCE
    base = json.loads((src / "config.json").read_text())
    old_default = {"full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": float(base["rope_local_base_freq"])}}
    assert (hf_logits(src, rope_parameters=old_default) - logits).abs().max() > 100 * FP32_TOLERANCE
