"""The CLI's conversion starts writing on a ModelSpec guessed from config.json while transformers'
config class reads the file in a forked child (toolkit/convert/spec_guess.py). What it writes must
be what the class's reading gives, whether the guess was right, wrong, or the class refuses the file.

The guessed path runs only where nothing has imported transformers (and one thread runs), so it is
exercised through the CLI in a fresh interpreter; the reference is the in-process conversion of
this test process, which has transformers imported and reads the class first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.convert import hf_to_megatron
from toolkit.convert.dist_format import IndexedReader
from toolkit.convert.metadata import META_FILE
from toolkit.convert.spec_guess import guess_spec
from toolkit.families import family_for, read_config
from toolkit.tinymodels import make_tiny_model

PUBLISHED = Path(__file__).parent / "data" / "published_configs"
# Published configs whose guess differs from the class's reading: DeepseekV3Config (and V3.2's) derives head_dim
# (absent from the files) from qk_rope_head_dim, the guess from hidden_size / num_attention_heads.
GUESSED_OTHERWISE = {"deepseek-v3.json", "deepseek-v3.2-exp.json", "kimi-k2-instruct.json"}

# The CLI, then whether this process imported transformers itself (it must not, on a right guess).
CLI = """
import sys, toolkit.cli
code = toolkit.cli.main(sys.argv[1:])
print("transformers imported:", "transformers" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, timeout=300)


def _meta(directory: Path) -> dict:
    """The toolkit's metadata (spec, layout, every file's checksum). DCP's index (release/.metadata)
    also records the directory it was written to and random save ids: its checksum is left out and
    its tensor index returned instead."""
    meta = json.loads((directory / META_FILE).read_text())
    if meta["format"] == "torch_dist":
        index = IndexedReader(directory / "release").read_metadata()
        del meta["checksums"]["release/.metadata"]
        meta["dcp index"] = (index.state_dict_metadata, index.storage_data)
    return meta


def test_the_guess_is_the_class_reading_for_the_published_configs():
    """A right guess saves the class's import time; a wrong one costs a restart. Every published
    config the guess can read is guessed right, but for the listed ones (a guard: they do differ)."""
    guessed = {}
    for path in sorted(PUBLISHED.glob("*.json")):
        cfg = json.loads(path.read_text())
        if path.name == "index.json" or "text_config" in cfg or cfg.get("model_type") in ("gemma3",):
            continue
        spec = guess_spec(cfg, family_for(cfg["model_type"]))
        if spec is not None:
            guessed[path.name] = spec == read_config(cfg, str(path))[1]
    assert {name for name, same in guessed.items() if not same} == GUESSED_OTHERWISE
    assert len(guessed) >= 35 and "llama-3.1-8b.json" in guessed  # the old-style rope_scaling is guessed too


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_cli_conversion_on_a_guess_writes_what_the_class_first_path_writes(tiny_hf, tmp_path, fmt):
    src = tiny_hf["llama3-scaled"]
    reference = hf_to_megatron(src, tmp_path / "reference", tp=2, pp=2, fmt=fmt)
    run = _cli("convert", "hf-to-megatron", str(src), str(tmp_path / "guessed"), "--tp", "2", "--pp", "2",
               "--format", fmt, "--no-progress")
    assert run.returncode == 0, run.stderr
    assert "transformers imported: False" in run.stderr  # the class was read in the child only
    assert _meta(tmp_path / "guessed") == _meta(reference)  # the spec, and every file's checksum


def test_a_config_the_class_refuses_stops_the_guessed_conversion_and_writes_nothing(hf_copy, tmp_path):
    src = hf_copy("llama-tied")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": "yes"}))
    assert guess_spec(json.loads((src / "config.json").read_text()), family_for("llama")) is not None  # guessed
    run = _cli("convert", "hf-to-megatron", str(src), str(tmp_path / "out"), "--no-progress")
    assert run.returncode != 0
    error = run.stderr.splitlines()[0]
    assert error.startswith("error: ") and "refused by transformers' LlamaConfig" in error, run.stderr
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no output, no .partial left


def test_a_wrong_guess_restarts_the_conversion_on_the_class_values(tmp_path):
    src = make_tiny_model("deepseek-v3", tmp_path / "hf", dtype="bfloat16")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["head_dim"]  # as published: DeepseekV3Config derives it from qk_rope_head_dim
    (src / "config.json").write_text(json.dumps(cfg))
    guess, read = guess_spec(cfg, family_for("deepseek_v3")), read_config(cfg)[1]
    assert guess.head_dim != read.head_dim  # the guess is wrong here
    reference = hf_to_megatron(src, tmp_path / "reference", tp=2, ep=2, layer_spec="local")
    run = _cli("convert", "hf-to-megatron", str(src), str(tmp_path / "guessed"), "--tp", "2", "--ep", "2",
               "--layer-spec", "local", "--no-progress")
    assert run.returncode == 0, run.stderr
    guessed = _meta(tmp_path / "guessed")
    assert guessed["spec"]["head_dim"] == read.head_dim
    assert guessed == _meta(reference)  # the spec, and every file's checksum
