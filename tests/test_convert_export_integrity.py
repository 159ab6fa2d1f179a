"""megatron-to-hf never exports a corrupt or inconsistent checkpoint: every shard's checksum is
checked as it is read, and the metadata is cross-checked against the shards and the HF config."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import blake3
import pytest

from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.metadata import CheckpointMeta, bad_checksums
from toolkit.errors import ToolkitError

META = "toolkit_checkpoint.json"


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {
        "torch": hf_to_megatron(tiny_hf["llama"], root / "torch", tp=2, pp=2, progress=False),
        "torch_dist": hf_to_megatron(tiny_hf["llama"], root / "dist", fmt="torch_dist", progress=False),
    }


@pytest.fixture
def ckpt_copy(converted, tmp_path):
    def copy(fmt: str = "torch") -> Path:
        return Path(shutil.copytree(converted[fmt], tmp_path / f"ckpt-{fmt}"))

    return copy


def export_fails(ckpt: Path, out: Path, match: str, **kwargs) -> None:
    with pytest.raises(ToolkitError, match=match) as info:
        megatron_to_hf(ckpt, out, progress=False, **kwargs)
    assert "\n" not in str(info.value), "errors are one line"
    assert not out.exists(), "a failed export must not create its output"
    assert not list(out.parent.glob(f".{out.name}.*")), "no partial directory or lock may be left behind"


def largest_shard(ckpt: Path) -> Path:
    return max((p for p in (ckpt / "release").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def as_written_before_blake3(ckpt: Path) -> Path:
    """Record every file's checksum as releases before BLAKE3 did: bare sha256 hex, computed here
    with hashlib, independently of toolkit.checksum."""
    def to_sha256(meta):
        meta["checksums"] = {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest() for name in meta["checksums"]}
    edit_json(ckpt / META, to_sha256)
    return ckpt


def test_new_checkpoints_record_blake3_of_each_file(converted):
    meta = json.loads((converted["torch"] / META).read_text())
    assert meta["checksums"] and all(digest == "blake3:" + blake3.blake3((converted["torch"] / name).read_bytes()).hexdigest()
                                     for name, digest in meta["checksums"].items())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_with_sha256_checksums_still_exports_and_verifies(ckpt_copy, tmp_path, fmt):
    ckpt = as_written_before_blake3(ckpt_copy(fmt))
    assert bad_checksums(ckpt, CheckpointMeta.read(ckpt)) == []
    assert (megatron_to_hf(ckpt, tmp_path / "out", progress=False) / "config.json").exists()


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_bit_flipped_shard_is_refused_by_export(ckpt_copy, tmp_path, fmt, algorithm):
    ckpt = ckpt_copy(fmt)
    if algorithm == "sha256":
        as_written_before_blake3(ckpt)
    shard = largest_shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    export_fails(ckpt, tmp_path / "out", f"{shard.name}.*checksum")
    assert bad_checksums(ckpt, CheckpointMeta.read(ckpt)) == [str(shard.relative_to(ckpt))], "verify names it too"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_truncated_shard_is_refused_by_export(ckpt_copy, tmp_path, fmt):
    ckpt = ckpt_copy(fmt)
    shard = largest_shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:-100])
    export_fails(ckpt, tmp_path / "out", f"{shard.name}.*checksum")


def test_missing_shard_is_refused_by_export(ckpt_copy, tmp_path):
    ckpt = ckpt_copy()
    shutil.rmtree(ckpt / "release" / "mp_rank_01_001")
    export_fails(ckpt, tmp_path / "out", "mp_rank_01_001")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_metadata_layer_count_edited_is_refused(ckpt_copy, tmp_path, fmt):
    ckpt = ckpt_copy(fmt)
    edit_json(ckpt / META, lambda m: m["spec"].__setitem__("num_layers", 3))
    export_fails(ckpt, tmp_path / "out", "num_layers.*3.*hf/config.json.*6")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_metadata_and_config_edited_together_are_refused_by_the_shards(ckpt_copy, tmp_path, fmt):
    ckpt = ckpt_copy(fmt)
    edit_json(ckpt / META, lambda m: m["spec"].__setitem__("num_layers", 2))
    edit_json(ckpt / "hf" / "config.json", lambda c: c.__setitem__("num_hidden_layers", 2))
    export_fails(ckpt, tmp_path / "out", "do not match the metadata")


def test_metadata_layout_contradicting_the_files_is_refused(ckpt_copy, tmp_path):
    ckpt = ckpt_copy()
    edit_json(ckpt / META, lambda m: m.update(tp=1, pp=4))
    export_fails(ckpt, tmp_path / "out", "TP=2 PP=2.*metadata says TP=1 PP=4")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["spec"].__setitem__("hidden_size", 128), "hidden_size=128 but .*hf/config.json implies 64"),
    (lambda m: m.__setitem__("vocab_size", 250), "vocab_size=250 but its spec says 256"),
])
def test_metadata_sizes_edited_are_refused(ckpt_copy, tmp_path, edit, match):
    ckpt = ckpt_copy()
    edit_json(ckpt / META, edit)
    export_fails(ckpt, tmp_path / "out", match)


def write_meta_bytes(data: bytes):
    return lambda ckpt: (ckpt / META).write_bytes(data)


def edit_meta(change):
    return lambda ckpt: edit_json(ckpt / META, change)


def replace_with_dir(relative: str):
    def damage(ckpt):
        path = ckpt / relative
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.mkdir()

    return damage


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda c: (c / META).write_bytes((c / META).read_bytes()[:-40]), f"{META} is not valid JSON"),
        (write_meta_bytes(b"[]"), f"{META} must hold a JSON object"),
        (write_meta_bytes(b'{"tp": "\xff"}'), f"{META} is not valid UTF-8"),
        (edit_meta(lambda m: m.update(shard_size=1)), "unknown key 'shard_size'"),
        (edit_meta(lambda m: m.pop("tp")), "missing key 'tp'"),
        (edit_meta(lambda m: m.update(tp="2")), "'tp' must be int"),
        (edit_meta(lambda m: m.update(checksums=[])), "'checksums' must be dict"),
        (edit_meta(lambda m: m["spec"].update(attention_chunk_size=8)), "unknown key 'attention_chunk_size'"),
        (edit_meta(lambda m: m["spec"].update(num_layers="6")), "'num_layers' must be int"),
        (lambda c: shutil.rmtree(c / "hf"), "hf/config.json"),
        (replace_with_dir("hf/config.json"), "hf/config.json"),
        (lambda c: (c / "hf" / "config.json").write_bytes(b"\xff"), "config.json is not valid UTF-8"),
        (lambda c: (c / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe"), "not valid UTF-8"),
        (replace_with_dir("release/mp_rank_00_000/model_optim_rng.pt"), "model_optim_rng.pt"),
        (replace_with_dir(META), f"{META} is missing or not a regular file"),
    ],
    ids=["meta-truncated", "meta-list", "meta-utf8", "meta-unknown-key", "meta-missing-key", "meta-wrong-type",
         "meta-checksums-list", "spec-unknown-key", "spec-wrong-type", "hf-dir-missing", "hf-config-dir",
         "hf-config-utf8", "tracker-utf8", "rank-file-dir", "meta-dir"],
)
def test_malformed_checkpoint_fails_in_one_line(ckpt_copy, tmp_path, damage, match):
    ckpt = ckpt_copy()
    damage(ckpt)
    export_fails(ckpt, tmp_path / "out", match)


def test_megatron_lm_checkpoint_with_truncated_rank_file_fails_in_one_line(ckpt_copy, tiny_hf, tmp_path):
    """No metadata, so no checksums: the torch loader's own error must still be one line."""
    ckpt = ckpt_copy()
    (ckpt / META).unlink()
    rank_file = ckpt / "release" / "mp_rank_00_000" / "model_optim_rng.pt"
    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])
    export_fails(ckpt, tmp_path / "out", "model_optim_rng.pt cannot be read", hf_config=tiny_hf["llama"])


def test_intact_checkpoint_still_exports(converted, tmp_path):
    out = megatron_to_hf(converted["torch_dist"], tmp_path / "out", progress=False)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@pytest.mark.parametrize("fmt, edit, match", [
    ("torch", {"format": "torch_dist"}, "holds a torch checkpoint but the metadata says format 'torch_dist'"),
    ("torch_dist", {"format": "torch"}, "holds a torch_dist checkpoint but the metadata says format 'torch'"),
    ("torch", {"layer_spec": "megatron"}, "layer_spec 'megatron' is not one of"),
])
def test_metadata_format_contradicting_the_files_is_refused(ckpt_copy, tmp_path, fmt, edit, match):
    ckpt = ckpt_copy(fmt)
    edit_json(ckpt / META, lambda m: m.update(edit))
    export_fails(ckpt, tmp_path / "out", match)
