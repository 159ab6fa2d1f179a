"""`--overwrite` swaps the old output out and the new one in with two renames; SIGKILL between
them must lose nothing, and the next run must put things right."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from toolkit.convert import hf_to_megatron
from toolkit.errors import ToolkitError


def layout_of(directory) -> tuple[int, int]:
    meta = json.loads((directory / "toolkit_checkpoint.json").read_text())
    return meta["tp"], meta["pp"]


def kill_at_fault_point(point: str, argv: list[str], flag) -> int:
    """Run the CLI until it pauses at `point` (toolkit.atomic.fault_point), SIGKILL it; its pid."""
    env = {**os.environ, "TOOLKIT_FAULT_PAUSE": f"{point}:{flag}"}
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", *argv], env=env)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None, f"the command exited before reaching the fault point {point}"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.pid


def test_kill_9_between_the_overwrite_renames_keeps_the_old_copy_and_the_next_run_restores_it(tiny_hf, tmp_path):
    out = tmp_path / "out"
    hf_to_megatron(tiny_hf["llama"], out, progress=False)  # the old result: TP1 x PP1
    pid = kill_at_fault_point("between-renames", ["convert", "hf-to-megatron", str(tiny_hf["llama"]), str(out),
                                                   "--tp", "2", "--pp", "2", "--overwrite", "--no-progress"],
                              tmp_path / "paused")
    # Old moved aside, new not yet in: no OUT_DIR, never a mixture, the old copy whole.
    assert not out.exists()
    assert [p.name for p in tmp_path.glob(".out.old-*")] == [f".out.old-{pid}"]
    assert layout_of(tmp_path / f".out.old-{pid}") == (1, 1)

    # The next run rolls the interrupted swap back: a run without --overwrite finds the old copy
    # where it was and refuses to replace it; with --overwrite it replaces it and nothing is left over.
    with pytest.raises(ToolkitError, match="not empty"):
        hf_to_megatron(tiny_hf["llama"], out, tp=2, pp=2, progress=False)
    assert layout_of(out) == (1, 1)
    hf_to_megatron(tiny_hf["llama"], out, tp=2, pp=2, overwrite=True, progress=False)
    assert layout_of(out) == (2, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "paused"], "no .old or .partial directory left"
