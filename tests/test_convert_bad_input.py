"""Bad input fails early with one actionable line, and writes nothing."""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.convert import hf_to_megatron
from toolkit.checksum import file_digest
from toolkit.errors import ToolkitError


def convert_fails(src: Path, out: Path, match: str, **kwargs) -> None:
    with pytest.raises(ToolkitError, match=match):
        hf_to_megatron(src, out, progress=False, **kwargs)
    assert not out.exists(), "a failed conversion must not create its output"
    assert not list(out.parent.glob(f".{out.name}.partial-*")), "no partial directory may be left behind"


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))


def edit_tensors(src: Path, change) -> None:
    path = src / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def rewrite_header(path: Path, change) -> None:
    """Edit the JSON header in place, keeping its length (padding with spaces)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= n
    path.write_bytes(data[:8] + encoded.ljust(n) + data[8 + n :])


def test_missing_config_json(hf_copy, tmp_path):
    src = hf_copy()
    (src / "config.json").unlink()
    convert_fails(src, tmp_path / "out", "no config.json")


def test_no_weights(hf_copy, tmp_path):
    src = hf_copy()
    (src / "model.safetensors").unlink()
    convert_fails(src, tmp_path / "out", "contains no weights")


def test_bin_only_weights_are_refused_not_unpickled(hf_copy, tmp_path):
    src = hf_copy()
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not even a pickle")
    convert_fails(src, tmp_path / "out", "pickled .bin")


def test_missing_tensor(hf_copy, tmp_path):
    src = hf_copy()
    edit_tensors(src, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    convert_fails(src, tmp_path / "out", "missing.*model.layers.3.mlp.up_proj.weight")


def test_extra_tensor(hf_copy, tmp_path):
    src = hf_copy()
    edit_tensors(src, lambda t: t.__setitem__("model.layers.0.self_attn.rotary.inv_freq", torch.zeros(8)))
    convert_fails(src, tmp_path / "out", "unexpected tensor")


def test_stored_rotary_frequencies_are_left_out_with_a_line_as_transformers_ignores_them(hf_copy, tmp_path, capfd):
    """Older checkpoints store each layer's `rotary_emb.inv_freq` (float32 among bf16 weights);
    transformers recomputes them and drops them on load. Before: `2 unexpected tensor(s) for llama`."""
    from tests.test_convert_roundtrip import load_all
    from toolkit.convert import megatron_to_hf

    src = hf_copy()
    original = load_all(src)
    edit_tensors(src, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                          for i in (0, 1)}))
    out = hf_to_megatron(src, tmp_path / "out", progress=False)
    assert "2 stored rotary frequency buffer(s) (e.g. 'model.layers.0.self_attn.rotary_emb.inv_freq') are left out" \
        in capfd.readouterr().err
    back = load_all(megatron_to_hf(out, tmp_path / "back", progress=False))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)


def test_shape_contradicting_config(hf_copy, tmp_path):
    src = hf_copy()
    edit_config(src, intermediate_size=96)
    convert_fails(src, tmp_path / "out", "shape .* config.json implies")


def test_truncated_safetensors(hf_copy, tmp_path):
    src = hf_copy()
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    convert_fails(src, tmp_path / "out", "truncated")


def test_safetensors_offsets_inconsistent_with_shape(hf_copy, tmp_path):
    src = hf_copy()

    def shift(header):
        entry = header["model.norm.weight"]
        entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] - 2]

    rewrite_header(src / "model.safetensors", shift)
    convert_fails(src, tmp_path / "out", "do not match its shape")


def test_safetensors_overlapping_tensors(hf_copy, tmp_path):
    src = hf_copy()

    def overlap(header):
        a, b = header["model.norm.weight"], header["model.layers.0.input_layernorm.weight"]
        b["data_offsets"] = list(a["data_offsets"])

    rewrite_header(src / "model.safetensors", overlap)
    convert_fails(src, tmp_path / "out", "overlap")


def test_safetensors_header_length_garbage(hf_copy, tmp_path):
    src = hf_copy()
    path = src / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + path.read_bytes()[8:])
    convert_fails(src, tmp_path / "out", "corrupt or truncated header")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64, "rope_theta": 5e5}},
            "low_freq_factor",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_architecture_is_refused(hf_copy, tmp_path, changes, match):
    src = hf_copy()
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", match)


def test_qwen2_per_layer_sliding_window_is_refused(hf_copy, tmp_path):
    src = hf_copy("qwen2")
    edit_config(src, use_sliding_window=True, sliding_window=16)
    convert_fails(src, tmp_path / "out", "use_sliding_window")


@pytest.mark.parametrize(
    "changes, layout, match",
    [
        ({}, {"tp": 3}, "attention heads are not divisible by --tp 3"),
        ({}, {"pp": 4}, "6 layers cannot be split evenly over --pp 4"),
        ({"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 48}, {"tp": 4},
         "neither divides"),
        ({}, {"tp": 0}, "must be >= 1"),
    ],
)
def test_layout_that_does_not_divide_is_refused(hf_copy, tmp_path, changes, layout, match):
    src = hf_copy()
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", match, **layout)


def test_existing_non_empty_output_refused_without_overwrite(tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ToolkitError, match="not empty.*--overwrite"):
        hf_to_megatron(tiny_hf["llama"], out, progress=False)
    assert (out / "keep.txt").read_text() == "user data"
    hf_to_megatron(tiny_hf["llama"], out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "toolkit_checkpoint.json").is_file()
    assert not list(tmp_path.glob(".out.*")), "the swapped-out old directory must be deleted"


def test_existing_empty_output_directory_is_used(tiny_hf, tmp_path):
    (tmp_path / "out").mkdir()
    hf_to_megatron(tiny_hf["llama"], tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "toolkit_checkpoint.json").is_file()


def test_output_under_a_regular_file_is_refused(tiny_hf, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ToolkitError, match="is not a directory"):
        hf_to_megatron(tiny_hf["llama"], tmp_path / "file" / "out", progress=False)


class _Planted:
    def __reduce__(self):
        return (os.system, ("touch /tmp/toolkit-pickle-planted",))


def test_untrusted_pickle_is_not_executed(tiny_hf, tmp_path):
    from toolkit.convert import megatron_to_hf

    out = hf_to_megatron(tiny_hf["llama"], tmp_path / "m", progress=False)
    rank_file = out / "release" / "mp_rank_00" / "model_optim_rng.pt"
    marker = Path("/tmp/toolkit-pickle-planted")
    marker.unlink(missing_ok=True)
    rank_file.write_bytes(b"")
    torch.save({"model": {}, "planted": _Planted()}, rank_file, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    meta = json.loads((out / "toolkit_checkpoint.json").read_text())  # an attacker can edit the checksum too
    meta["checksums"]["release/mp_rank_00/model_optim_rng.pt"] = file_digest(rank_file)
    (out / "toolkit_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ToolkitError, match="allow-list"):
        megatron_to_hf(out, tmp_path / "h", progress=False)
    assert not marker.exists(), "the planted object ran"


def cli(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, "-m", "toolkit", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, **kwargs)


def test_cli_prints_one_line_error_and_exits_2(hf_copy, tmp_path):
    src = hf_copy()
    (src / "config.json").unlink()
    result = cli("convert", "hf-to-megatron", src, tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr


def test_kill_9_before_rename_leaves_no_finished_looking_output_and_rerun_succeeds(tiny_hf, tmp_path):
    out, flag = tmp_path / "out", tmp_path / "paused"
    env = {"TOOLKIT_FAULT_PAUSE": f"before-rename:{flag}"}
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(tiny_hf["llama"]),
                             str(out), "--tp", "2", "--pp", "2", "--no-progress"], env={**os.environ, **env})
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None, "converter exited before reaching the fault point"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    partial = list(tmp_path.glob(".out.partial-*"))
    assert len(partial) == 1 and (partial[0] / "release").is_dir()  # complete files, but not where users look
    result = cli("convert", "hf-to-megatron", tiny_hf["llama"], out, "--tp", "2", "--pp", "2", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert (out / "toolkit_checkpoint.json").is_file()
    assert not list(tmp_path.glob(".out.partial-*")), "the stale partial directory is cleaned up on rerun"


# --- An output that is, contains or lies inside an input is refused before anything is touched ---


def tree_digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["same", "parent", "inside", "symlink-to-input"])
def test_hf_to_megatron_output_overlapping_input_is_refused_and_input_untouched(hf_copy, tmp_path, where):
    src = hf_copy()
    before = tree_digest(src)
    out = {"same": src, "parent": src.parent, "inside": src / "mcore", "symlink-to-input": tmp_path / "link"}[where]
    if where == "symlink-to-input":
        out.symlink_to(src)
    with pytest.raises(ToolkitError, match="overlaps the input"):
        hf_to_megatron(src, out, overwrite=True, progress=False)
    assert tree_digest(src) == before, "the input was modified"
    assert not (src / "mcore").exists() and not list(src.parent.glob(".*partial-*"))


@pytest.mark.parametrize("where", ["same", "inside", "hf-config-dir"])
def test_megatron_to_hf_output_overlapping_input_is_refused_and_input_untouched(hf_copy, tmp_path, where):
    from toolkit.convert import megatron_to_hf

    src = hf_copy()
    mcore = hf_to_megatron(src, tmp_path / "mcore", progress=False)
    before, hf_before = tree_digest(mcore), tree_digest(src)
    out = {"same": mcore, "inside": mcore / "hf-export", "hf-config-dir": src}[where]
    with pytest.raises(ToolkitError, match="overlaps the input"):
        megatron_to_hf(mcore, out, hf_config=src, overwrite=True, progress=False)
    assert tree_digest(mcore) == before and tree_digest(src) == hf_before, "an input was modified"


def test_output_symlink_to_nowhere_is_refused_in_one_line(tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "missing" / "target")
    with pytest.raises(ToolkitError, match="symbolic link to .*missing/target.*which does not exist"):
        hf_to_megatron(tiny_hf["llama"], out, progress=False)
    assert out.is_symlink() and not (tmp_path / "missing").exists()


# --- Lying or odd headers and configs ---


def all_tensors(change):
    def apply(header):
        for name, entry in header.items():
            if name != "__metadata__":
                change(name, entry)

    return apply


@pytest.mark.parametrize(
    "change, match",
    [
        (all_tensors(lambda n, e: e.__setitem__("dtype", "I16")), "I16.*only floating-point weights"),
        (lambda h: h["model.norm.weight"].__setitem__("dtype", "F16"), "F16.*config.json.*bfloat16"),
        (all_tensors(lambda n, e: e.__setitem__("dtype", "F16")), "F16.*config.json.*bfloat16"),
    ],
    ids=["bf16-as-i16", "one-tensor-f16", "all-f16"],
)
def test_safetensors_dtype_contradicting_config_is_refused(hf_copy, tmp_path, change, match):
    src = hf_copy()
    rewrite_header(src / "model.safetensors", change)
    convert_fails(src, tmp_path / "out", match)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_hidden_layers": "4"}, "num_hidden_layers.*expected int"),
        ({"hidden_size": [64]}, "hidden_size.*expected int"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps.*expected float"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings.*expected bool"),
    ],
)
def test_config_with_wrong_types_is_refused_by_transformers_rules(hf_copy, tmp_path, changes, match):
    src = hf_copy()
    edit_config(src, **changes)
    convert_fails(src, tmp_path / "out", match)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [10**12, 3, 0])
def test_layer_count_contradicting_the_files_fails_before_allocating(hf_copy, tmp_path, variant, layers):
    src = hf_copy(variant)
    edit_config(src, num_hidden_layers=layers)
    convert_fails(src, tmp_path / "out", f"num_hidden_layers={layers} but the weights hold 6 layers")


# --- Every user-reachable error is one line naming the file ---


def write_bytes(name: str, data: bytes):
    return lambda src: (src / name).write_bytes(data)


def make_dir_instead_of(name: str):
    def damage(src):
        (src / name).unlink()
        (src / name).mkdir()

    return damage


def index_with(weight_map):
    return write_bytes("model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode())


@pytest.mark.parametrize(
    "damage, match",
    [
        (write_bytes("config.json", b"[1, 2]"), "config.json must hold a JSON object"),
        (write_bytes("config.json", b'{"model_type": "llama\xff"}'), "config.json is not valid UTF-8"),
        (write_bytes("config.json", b'{"model_type": '), "config.json is not valid JSON"),
        (write_bytes("model.safetensors.index.json", b"[]"), "index.json must hold a JSON object"),
        (write_bytes("model.safetensors.index.json", b"\xfe\xff"), "index.json is not valid UTF-8"),
        (index_with(["model.safetensors"]), "weight_map must map tensor names to file names"),
        (index_with({"model.norm.weight": 3}), "weight_map must map tensor names to file names"),
        (index_with({"model.norm.weight": "../../etc/passwd"}), "names a file outside"),
        (make_dir_instead_of("model.safetensors"), "model.safetensors is not a regular file"),
        (make_dir_instead_of("config.json"), "no config.json"),
    ],
    ids=["config-list", "config-utf8", "config-truncated", "index-list", "index-utf8", "weight-map-list",
         "weight-map-int", "weight-map-escape", "weights-dir", "config-dir"],
)
def test_malformed_files_fail_in_one_line(hf_copy, tmp_path, damage, match):
    src = hf_copy()
    damage(src)
    convert_fails(src, tmp_path / "out", match)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h: h["model.norm.weight"].__setitem__("shape", "64"), "malformed header entry"),
        (lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, "x"]), "malformed header entry"),
        (lambda h: h["model.norm.weight"].__setitem__("shape", [-64]), "malformed header entry"),
    ],
    ids=["shape-string", "offset-string", "negative-dim"],
)
def test_safetensors_header_with_wrong_types_fails_in_one_line(hf_copy, tmp_path, change, match):
    src = hf_copy()
    rewrite_header(src / "model.safetensors", change)
    convert_fails(src, tmp_path / "out", match)


def test_safetensors_header_that_is_a_json_list_fails_in_one_line(hf_copy, tmp_path):
    src = hf_copy()
    path = src / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"[]".ljust(n) + data[8 + n:])
    convert_fails(src, tmp_path / "out", "header is not a JSON object")


@pytest.mark.parametrize("flag", [["--max-shard-gb", "inf"], ["--max-shard-gb", "nan"], ["--max-shard-gb", "0"],
                                  ["--seq-len", "0"], ["--batch", "-1"]])
def test_cli_numeric_options_out_of_range_fail_in_one_line(tiny_hf, tmp_path, flag):
    from toolkit.cli import main

    command = ["verify", tiny_hf["llama"], tmp_path] if flag[0] in ("--seq-len", "--batch") else \
        ["megatron-to-hf", tmp_path / "in", tmp_path / "out"]
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", *map(str, command), *flag])
    assert exit_info.value.code == 2


def test_cli_debug_shows_the_traceback(hf_copy, tmp_path):
    src = hf_copy()
    (src / "config.json").write_bytes(b"[]")
    result = cli("--debug", "convert", "hf-to-megatron", src, tmp_path / "out")
    assert result.returncode != 0 and "Traceback" in result.stderr and "ConversionError" in result.stderr


def test_overlap_check_for_file_outputs_next_to_their_inputs(tmp_path):
    """The shared check other writing commands use: a file written next to the input files it
    reads is fine; the input itself, or a path through it, is not."""
    from toolkit.atomic import refuse_output_overlapping_inputs

    run = tmp_path / "run"
    (run / "metrics.jsonl").parent.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "alias").symlink_to(run)
    refuse_output_overlapping_inputs(run / "loss.png", run / "metrics.jsonl", None)
    for out in (run / "metrics.jsonl", tmp_path / "alias" / "metrics.jsonl", tmp_path):
        with pytest.raises(ToolkitError, match="overlaps the input"):
            refuse_output_overlapping_inputs(out, run / "metrics.jsonl")


@pytest.mark.parametrize("damage, match", [
    (lambda hf, mc: (hf / "config.json").write_bytes(b"[]"), "config.json must hold a JSON object"),
    (lambda hf, mc: edit_config(hf, num_hidden_layers="6"), "num_hidden_layers.*expected int"),
    (lambda hf, mc: (mc / "toolkit_checkpoint.json").write_bytes(b"{"), "toolkit_checkpoint.json is not valid JSON"),
], ids=["hf-config-list", "hf-config-type", "meta-truncated"])
def test_verify_refuses_bad_input_in_one_line_before_launching(hf_copy, tmp_path, damage, match):
    from toolkit.convert import verify

    src = hf_copy()
    mcore = hf_to_megatron(src, tmp_path / "mcore", progress=False)
    damage(src, mcore)
    with pytest.raises(ToolkitError, match=match):
        verify(src, mcore)


def test_run_directory_export_may_go_inside_the_run_but_never_over_the_model(tiny_hf, tmp_path):
    """The overlap rule applies to the directory actually read (RUN_DIR/checkpoints/step_N/model)."""
    from toolkit.convert import megatron_to_hf

    run = tmp_path / "run"
    hf_to_megatron(tiny_hf["llama"], run / "checkpoints" / "step_0000001" / "model", progress=False)
    (run / "checkpoints" / "latest").write_text("step_0000001")
    assert (megatron_to_hf(run, run / "hf", progress=False) / "model.safetensors").is_file()
    with pytest.raises(ToolkitError, match="overlaps the input"):
        megatron_to_hf(run, run, overwrite=True, progress=False)
    assert (run / "checkpoints" / "step_0000001" / "model" / "toolkit_checkpoint.json").is_file()


# Quantized re-saves of text models that are not read (NVFP4 from ModelOpt, AWQ, GPTQ, compressed-tensors INT4,
# bitsandbytes): their weights are packed integers with scales, which read as bf16 would convert garbage.
QUANTIZED = {
    "modelopt": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_method='modelopt'"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"quant_method='awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq'"),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
                           r"quant_method='compressed-tensors', format='nvfp4-pack-quantized'\) is not read: its "
                           r"nvfp4-pack-quantized weights are decompressed by the compressed-tensors library"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'"),
}


@pytest.mark.parametrize("method", QUANTIZED)
def test_a_quantized_text_checkpoint_is_refused_in_one_line_naming_its_format(hf_copy, tmp_path, method):
    """Before, every one of these converted silently (its config's quantization_config was not looked at)."""
    quantization, match = QUANTIZED[method]
    src = hf_copy()
    edit_config(src, quantization_config=quantization)
    convert_fails(src, tmp_path / "out", rf"^[^\n]*config.json: a quantized llama checkpoint \([^\n]*{match}[^\n]*$")
