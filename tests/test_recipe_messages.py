"""Messages that name the fix: a rank started without a launcher, an unknown key, a missing
checkpoint, a port still held by another run; and the launcher watch's process bookkeeping."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.finetune_harness import RECIPE, recipe, recipe_config, write_uneven_data
from toolkit.errors import ConfigError


def test_plain_python_says_to_use_a_launcher_and_shows_the_command(tmp_path):
    """Old code: it went on to read the recipe and died in init_process_group (env:// needs RANK)."""
    cfg = recipe(tmp_path, tmp_path / "ckpt", write_uneven_data(tmp_path / "data.jsonl", 4))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(RECIPE), "--config", str(cfg)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "under a launcher" in lines[0], run.stderr
    assert f"deepspeed --num_gpus N {RECIPE} --config {cfg}" in lines[0]


def test_unknown_key_says_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr' \(did you mean 'optim.lr'\?") as e:
        recipe_config(tmp_path, ["optim.lrr=1e-4"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'paralel.tp' \(did you mean 'parallel.tp'\?"):
        recipe_config(tmp_path, ["paralel.tp=2"])


def test_missing_checkpoint_says_it_does_not_exist(tmp_path):
    """Old code: '... has no toolkit_meta.json: not a checkpoint written by this toolkit'."""
    from toolkit.train.build import read_checkpoint_meta

    cfg = recipe_config(tmp_path, [f"model.checkpoint={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"model.checkpoint .*nowhere does not exist: give the directory"):
        read_checkpoint_meta(cfg)


def test_a_port_in_use_is_one_line_that_names_the_fix(monkeypatch):
    """The DistNetworkError torch raises when MASTER_PORT is taken (what orphaned ranks cause)."""
    import torch.distributed as dist

    from toolkit.runtime.distributed import network_error_line

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(dist.DistNetworkError) as raised:
            dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    line = network_error_line(raised.value)
    assert "\n" not in line and f"127.0.0.1:{port}" in line and "address already in use" in line
    assert "--master_port" in line


def test_launcher_watch_sees_a_reparented_process():
    """The watch's test of death: a watched process whose parent changed. A child of this test
    that outlives its own child's parent (a double fork) is re-parented, as launch.py is when
    the `deepspeed` command is killed."""
    from toolkit.runtime import launcher_watch

    chain = [(os.getpid(), os.getppid())]
    assert launcher_watch._gone(chain) is None
    assert launcher_watch._gone([(os.getpid(), os.getppid() + 1)]) == os.getppid() + 1
    orphan = subprocess.run([sys.executable, "-c", "import os, time, subprocess, sys; "
                             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                             "print(p.pid, os.getpid(), flush=True)"], capture_output=True, text=True, timeout=60)
    child, its_parent = map(int, orphan.stdout.split())
    try:
        assert launcher_watch._gone([(child, its_parent)]) == its_parent  # its parent exited: re-parented
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
