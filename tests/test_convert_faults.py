"""Fault injection on real processes and a real file system: two writers racing for one output,
and a disk that fills up while the output is written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.convert import hf_to_megatron
from toolkit.errors import ToolkitError

PAUSE_TIMEOUT_S = 120


def start_paused(hf_dir: Path, out: Path, point: str, flag: Path, *extra: str) -> subprocess.Popen:
    """A conversion subprocess that stops at fault point `point` until `flag` is removed."""
    env = {**os.environ, "TOOLKIT_FAULT_PAUSE": f"{point}:{flag}"}
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(hf_dir), str(out),
                             "--no-progress", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + PAUSE_TIMEOUT_S
    while not flag.exists():
        assert proc.poll() is None, f"converter exited before {point}: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"converter never reached {point}"
        time.sleep(0.05)
    return proc


def error_line(stderr: str) -> str:
    """The CLI's one-line error (third-party warnings before it are not ours to judge here)."""
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), stderr
    return last


def resume(proc: subprocess.Popen, flag: Path) -> tuple[int, str]:
    flag.unlink()
    try:
        _, err = proc.communicate(timeout=PAUSE_TIMEOUT_S)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.fixture
def paused():
    procs = []
    yield procs
    for proc in procs:  # a failed assertion must not leave a paused converter behind
        proc.kill()
        proc.wait()


def test_two_writers_one_output_exactly_one_wins(tiny_hf, tmp_path, paused):
    out, flag = tmp_path / "out", tmp_path / "paused"
    first = start_paused(tiny_hf["llama"], out, "before-rename", flag)
    paused.append(first)
    with pytest.raises(ToolkitError, match=r"another process \(pid \d+\) is writing .*out"):
        hf_to_megatron(tiny_hf["llama-tied"], out, progress=False)
    with pytest.raises(ToolkitError, match="another process"):
        hf_to_megatron(tiny_hf["llama-tied"], out, overwrite=True, progress=False)
    code, err = resume(first, flag)
    assert code == 0, err
    spec = (out / "hf" / "config.json").read_text()
    assert '"tie_word_embeddings": false' in spec, "the first writer's result must be the one published"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no partial directory or lock file left"


def test_output_that_appears_during_conversion_is_never_replaced(tiny_hf, tmp_path, paused):
    out, flag = tmp_path / "out", tmp_path / "paused"
    writer = start_paused(tiny_hf["llama"], out, "before-rename", flag)
    paused.append(writer)
    out.mkdir()
    (out / "user.txt").write_text("someone else's data")
    code, err = resume(writer, flag)
    assert code == 2 and "appeared while" in error_line(err), err
    assert (out / "user.txt").read_text() == "someone else's data" and len(list(out.iterdir())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_larger_than_free_space_is_refused_before_writing(tiny_hf, small_fs):
    fs = small_fs("64k")
    out = fs / "out"
    with pytest.raises(ToolkitError, match=r"needs about .* only .* free on .*small"):
        hf_to_megatron(tiny_hf["llama"], out, progress=False)
    assert list(fs.iterdir()) == []


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_disk_full_mid_write_cleans_up_and_says_how_much_space_is_needed(tiny_hf, small_fs, tmp_path, paused, fmt):
    fs = small_fs("2m")
    out, flag = fs / "out", tmp_path / "paused"
    writer = start_paused(tiny_hf["llama"], out, "after-space-check", flag, "--format", fmt)
    paused.append(writer)
    free = shutil.disk_usage(fs).free
    (fs / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # another program fills the disk meanwhile
    code, err = resume(writer, flag)
    assert code == 2, err
    line = error_line(err)
    assert "no space left" in line and "needs about" in line and "free" in line, err
    assert sorted(p.name for p in fs.iterdir()) == ["filler"], "the partial output must be removed"
