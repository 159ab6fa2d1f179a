"""The process launcher, the CPU compatibility layer's bookkeeping, and the CLI shell."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.errors import DistributedError
from toolkit.runtime.launch import run_on_processes


def test_launcher_surfaces_the_failing_ranks_traceback():
    with pytest.raises(DistributedError, match=r"rank 1 of 2 failed(.|\n)*ValueError: planted failure"):
        run_on_processes("tests.mp_workers:fail_on_rank_one", 2, "planted failure", cpu=True)  # no GPU use


def test_launcher_fails_fast_when_a_rank_dies():
    began = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 died with exit code 7"):
        run_on_processes("tests.mp_workers:die_on_rank_one", 2, cpu=True)
    assert time.monotonic() - began < 30, "the surviving rank must be killed, not waited for"


@pytest.mark.parametrize("world, cuda, gpus, cpu, expected", [
    (4, False, 0, False, "cpu"),  # no CUDA: gloo on CPU, as always
    (4, True, 4, False, "cuda"),
    (2, True, 8, False, "cuda"),
    (4, True, 4, True, "cpu"),  # asked for
    (4, True, 1, True, "cpu"),
])
def test_launch_device_follows_cuda_and_the_cpu_flag(world, cuda, gpus, cpu, expected):
    from toolkit.runtime.launch import launch_device

    assert launch_device(world, cuda, gpus, cpu) == expected


def test_more_processes_than_gpus_is_refused_with_both_numbers():
    """LOCAL_RANK = rank: rank 2 of 4 on a 2-GPU machine would fail at set_device."""
    from toolkit.runtime.launch import launch_device

    with pytest.raises(DistributedError, match=r"4 processes need 4 GPUs \(one per process\), 2 available.*--cpu"):
        launch_device(4, True, 2, False)


def test_rendezvous_ports_come_from_below_the_kernels_ephemeral_range():
    """A port from the ephemeral range (binding port 0) can be taken by another process's outgoing
    connection before the launcher binds it: a launch failed with EADDRINUSE on 41719 while the other
    test file's ranks connected. Those are never handed out below the range."""
    import socket

    from toolkit.runtime.launch import free_port

    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < first_ephemeral for port in ports), (sorted(ports), first_ephemeral)
    assert len(ports) > 1  # chosen at random, so two launches at once rarely meet
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_cpu_patches_name_their_upstream_spots():
    from toolkit.runtime import cpu_compat

    assert set(cpu_compat._PATCHES) == set(cpu_compat.UPSTREAM_SPOTS)
    assert all(".py:" in spot for spot in cpu_compat.UPSTREAM_SPOTS.values())
    for where, spot in cpu_compat.MODEL_BUILD_SPOTS.items():  # the stand-ins applied while a model is built
        path, name = where.split()[:2]
        assert ".py:" in spot and name in (Path(__file__).resolve().parents[1] / path).read_text(), where


def toolkit(*args):
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True)


HEAVY_MODULES = ("torch", "deepspeed", "megatron", "transformers", "matplotlib")


def test_help_imports_no_heavy_library():
    """What makes --help fast, checked without a clock (a wall-clock bound flakes on a busy machine)."""
    probe = ("import sys\nfrom toolkit.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", "heavy libraries must be imported lazily"


def test_help_lists_every_command():
    result = toolkit("--help")
    assert result.returncode == 0
    for command in ("convert", "quickstart", "ds-config", "plot"):
        assert command in result.stdout
    assert "Memory" in toolkit("convert", "verify", "--help").stdout


def test_convert_help_names_every_supported_model_type():
    """The list was written by hand and fell behind (gemma3_text, olmo2, olmoe, qwen2_moe missing)."""
    from toolkit.families import FAMILIES

    text = toolkit("convert", "hf-to-megatron", "--help").stdout
    missing = [t for family in FAMILIES for t in family.model_types if t not in text]
    assert not missing, f"convert --help does not name {missing}"


def test_cli_vocab_divisor_default_is_the_library_default():
    from toolkit.commands import convert
    from toolkit.layouts import DEFAULT_VOCAB_DIVISOR

    import argparse

    parser = argparse.ArgumentParser()
    convert.register(parser.add_subparsers())
    args = parser.parse_args(["convert", "hf-to-megatron", "a", "b"])
    assert args.vocab_divisor == DEFAULT_VOCAB_DIVISOR


def test_every_help_text_reads_as_written():
    """argparse formats argument help with %, not descriptions: a description's `%%` was printed as is."""
    import argparse

    from toolkit.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    found = list(parsers(build_parser()))
    assert len(found) > 10
    for parser in found:
        assert "%%" not in parser.format_help(), parser.prog


def test_output_into_a_closed_pipe_ends_quietly(tiny_hf):
    """`toolkit ckpt inspect DIR | head` (README walkthrough): the reader leaves early, the write
    fails with EPIPE; the command ends with the shell's SIGPIPE status, not a traceback."""
    import subprocess
    import sys

    command = ["memory", str(tiny_hf["llama"]), "--gpus", "8", "--tp", "2", "--pp", "2", "--zero", "1",
               "--micro-batch", "1", "--global-batch", "16"]
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the command writes
    stderr = proc.stderr.read().decode()
    assert proc.wait() == 141 and stderr == "", stderr
