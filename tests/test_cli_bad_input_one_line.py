"""Bad input to the CLI's planning commands is one line and exit 2, never a traceback or silence
(issue 25, section 5): the checks `convert` makes on a config.json, shared by `memory` and `plan`."""

from __future__ import annotations

import json

import pytest

from toolkit.cli import main


def _config(tiny_hf, tmp_path, **changes):
    cfg = json.loads((tiny_hf["llama"] / "config.json").read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        cfg.pop(key)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _one_line_error(capsys, code: int, *words: str) -> str:
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def test_memory_refuses_a_string_layer_count_as_convert_does(tiny_hf, tmp_path, capsys):
    config = _config(tiny_hf, tmp_path, num_hidden_layers="6")
    _one_line_error(capsys, main(["memory", str(config), "--gpus", "1"]), "num_hidden_layers")


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_zero_attention_heads_is_one_line(tiny_hf, tmp_path, capsys, command):
    config = _config(tiny_hf, tmp_path, num_attention_heads=0, head_dim=None)
    argv = ["memory", str(config), "--gpus", "1"] if command == "memory" else \
        ["plan", "--model", str(config), "--gpus", "1", "--gpu-memory", "80GiB"]
    _one_line_error(capsys, main(argv), "num_attention_heads=0", "at least 1")


def test_invalid_utf8_in_a_deepspeed_json_is_one_line(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"train_batch_size": 8, "comment": "caf\xe9"}')
    _one_line_error(capsys, main(["ds-config", "check", str(path)]), str(path), "UTF-8")


@pytest.mark.parametrize("flags", [["--gpus", "0"], ["--nodes", "0"]])
def test_plan_on_no_gpus_says_so(tiny_hf, capsys, flags):
    code = main(["plan", "--model", str(tiny_hf["llama"]), *flags, "--gpu-memory", "80GiB"])
    _one_line_error(capsys, code, flags[0], "at least 1")
