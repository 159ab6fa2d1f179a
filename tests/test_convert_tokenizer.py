"""A checkpoint converted without tokenizer files converts (and verifies), but training cannot
load its tokenizer: conversion says so in one line, with the fix."""

from __future__ import annotations

from toolkit.convert import hf_to_megatron


def test_conversion_without_tokenizer_files_warns_in_one_line_naming_them_and_the_fix(hf_copy, tmp_path, capsys):
    src = hf_copy("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    out = hf_to_megatron(src, tmp_path / "out", progress=False)
    err = capsys.readouterr().err.strip()
    assert (out / "toolkit_checkpoint.json").is_file(), "it still converts"
    assert err.count("\n") == 0 and err.startswith("warning: "), err
    assert "tokenizer.json" in err and "tokenizer.model" in err and "training" in err
    assert f"{out}/hf/" in err, "says where to copy them"


def test_conversion_with_a_tokenizer_says_nothing(tiny_hf, tmp_path, capsys):
    hf_to_megatron(tiny_hf["llama"], tmp_path / "out", progress=False)
    assert "warning" not in capsys.readouterr().err
