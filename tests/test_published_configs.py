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
WINDOWS_PROVEN_ELSEWHERE = {"phi-3-mini-4k-instruct": "tests/test_family_phi3.py"}
NOT_KEYS = ("model_type", "architectures", "transformers_version")


def outcome(cfg: dict):
    """The spec, or the refusal without the key naming that may differ by where the file put it."""
    try:
        return spec_from_config(cfg)[1]
    except ConversionError as e:
        return "refused: " + str(e).split(": ", 1)[-1]


def as_transformers_saves(cfg: dict, tmp_path: Path) -> dict | None:
    """cfg after transformers' config class read it and save_pretrained wrote it, or None when
    transformers itself refuses cfg."""
    from transformers import CONFIG_MAPPING

    from toolkit.families import family_for

    try:
        model_type = family_for(cfg["model_type"]).config_class_of.get(cfg["model_type"], cfg["model_type"])
        config = CONFIG_MAPPING[model_type].from_dict(json.loads(json.dumps(cfg)))
    except Exception:  # transformers' own refusal: nothing to compare with
        return None
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(corpus.index()))
def test_each_key_left_out_reads_as_transformers_own_save_of_that_config(name, tmp_path):
    published = corpus.config(name)
    compared, differ = 0, []
    for key in sorted(set(published) - set(NOT_KEYS)):
        left_out = {k: v for k, v in published.items() if k != key}
        saved = as_transformers_saves(left_out, tmp_path / key)
        if saved is None:
            continue
        ours, theirs = outcome(left_out), outcome(saved)
        if ours != theirs:
            differ.append(f"without {key!r}: {_difference(ours, theirs)}")
        compared += 1
    assert not differ, f"{name}:\n" + "\n".join(differ)
    assert compared >= (len(published) - len(NOT_KEYS)) // 2, "transformers refused most variants: compared too few"


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
    line (none today: LongRoPE was the last); an entry that converts but is not verified (index.json
    "unverified" says why) must convert at TP2 x PP2 x EP2. One test over the lists rather than a parameter
    per entry, so an empty list is not reported as a skip."""
    for name in corpus.refused():
        src = corpus.build_model(name, tmp_path / name / "hf")
        convert_fails(src, tmp_path / name / "out", r"^[^\n]*" + re.escape(corpus.index()[name]["outcome"]) + r"[^\n]*$",
                      **corpus.convert_options(name))
    for name in corpus.converting_unverified():  # DeepSeek-V3 and Kimi-K2 as published: FP8, a float32 expert bias
        src = corpus.build_model(name, tmp_path / name / "hf")
        hf_to_megatron(src, tmp_path / name / "out", tp=2, pp=2, ep=2, progress=False, **corpus.convert_options(name))


def test_the_parity_sequence_passes_every_window_but_those_proven_elsewhere():
    """A window that binds (shorter than max_position_embeddings; Phi-3.5's 262144 never does) and
    that SEQ_LEN does not pass must be named, with the test that proves its semantics instead."""
    unpassed = set()
    for name in corpus.converting():
        cfg = corpus.config(name)
        window = spec_from_config(cfg)[1].window_size
        if window and SEQ_LEN <= window < cfg["max_position_embeddings"]:
            unpassed.add(name)
    assert unpassed == set(WINDOWS_PROVEN_ELSEWHERE)


@pytest.mark.multiprocess
def test_published_configs_convert_at_tp2_pp2_ep2_and_match_hf_logits(tmp_path):
    """One launch of 8 processes (TP2 x PP2 x EP2; the dense models run with DP 2) verifies every
    converting config of the corpus on sequences longer than its windows."""
    from toolkit.convert.parity import verify_many

    # A published file identical to another's once shrunk (Mixtral 8x7B Instruct's and the base's,
    # Qwen3 0.6B's and 1.7B's) would verify the same model again: the first of them stands for both.
    first = {json.dumps(corpus.config(name), sort_keys=True): name for name in reversed(corpus.converting())}
    cases = [(name, corpus.build_model(name, tmp_path / name)) for name in corpus.converting() if name in first.values()]
    # and Gemma 3 without the keys a multimodal text_config leaves out: converted with 10,000 as
    # the global RoPE base, this was silently wrong (transformers' default is 1e6)
    cases.append((f"{GEMMA3} without {GEMMA3_TEXT_CONFIG_LEAVES_OUT}",
                  corpus.build_model(GEMMA3, tmp_path / "gemma3-defaults", leave_out=GEMMA3_TEXT_CONFIG_LEAVES_OUT)))
    pairs = []
    for i, (name, src) in enumerate(cases):
        ep = 2 if spec_from_config(json.loads((src / "config.json").read_text()))[1].is_moe else 1
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
