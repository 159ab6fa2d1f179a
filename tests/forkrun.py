"""The tests' launcher: N ranks of a script, forked from one process that imported the libraries once.

    python tests/forkrun.py NPROCS SCRIPT [ARGS...]

torchrun starts every rank as a fresh interpreter, and importing torch, megatron-core, DeepSpeed
and transformers costs each rank about 8 s of CPU: on two cores that is most of what a tiny test
run costs. Here the parent imports them once and forks the ranks, which then run SCRIPT as
`__main__` with the environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). As torchrun does, the first rank that fails stops
the others and its exit code is the launcher's. Nothing here initialises CUDA or a process group
before the fork; with CUDA present the tests use torchrun instead (tests/finetune_harness.py).

The tests about launching itself (torchrun, DeepSpeed's launcher, signals, SIGKILL and requeue)
use the real launchers; this one only removes repeated start-up cost from the others.

    python tests/forkrun.py --serve SOCKET

serves launches instead: it imports once for every launch of a test process (tests/finetune_harness.py
starts one per pytest worker), and per request forks a launcher that takes the request's working
directory, environment and output files, then forks the ranks as above. The parent never runs a
rank's code, so each launch starts from the same freshly imported state. One request at a time
(JSON lines over a Unix socket): {"nprocs", "script", "args", "env", "cwd", "stdout", "stderr"},
answered with {"pid"} (the launcher's, which leads its own process group), then {"code"}.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

GRACE_S = 10  # after a rank fails, how long the others get to exit on SIGTERM
PORT_ENV = "FORKRUN_MASTER_PORT"


def preload() -> None:
    """Import what the ranks would each import (the parent's only work)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from toolkit.runtime.distributed import choose_deepspeed_accelerator

    choose_deepspeed_accelerator()  # as recipes/finetune.py does, before DeepSpeed is imported
    from toolkit.runtime.quiet import quiet_third_party

    quiet_third_party(False)
    from toolkit.runtime.launch import HEAVY_IMPORTS

    for name in HEAVY_IMPORTS:
        importlib.import_module(name)


def run_rank(rank: int, nprocs: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a torchrun rank
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def stop(pids: dict[int, int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        else:
            time.sleep(0.1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def shell_code(status: int) -> int:
    """A child's exit code from its wait status; killed by signal N: 128 + N, as a shell reports it."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def launch_ranks(nprocs: int, script: str, args: list[str]) -> int:
    """Fork the ranks of `script` (libraries already imported) and wait for them, as torchrun does."""
    from toolkit.runtime.launch import free_port

    port = int(os.environ.get(PORT_ENV) or free_port())  # a test may ask for a port a killed run held
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:  # the rank: exit through the interpreter, so atexit handlers (W&B, ...) run
            sys.exit(run_rank(rank, nprocs, port, script, args))
        pids[pid] = rank
    while pids:
        pid, status = os.wait()
        pids.pop(pid)
        code = shell_code(status)
        if code != 0:
            stop(pids)
            return code
    return 0


def main() -> int:
    nprocs, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    preload()
    return launch_ranks(nprocs, script, args)


def serve(path: str) -> None:
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as stream:
            request = json.loads(stream.readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                os._exit(_launcher(request))
            stream.write(json.dumps({"pid": pid}) + "\n")
            stream.flush()
            _, status = os.waitpid(pid, 0)
            stream.write(json.dumps({"code": shell_code(status)}) + "\n")


def _state_the_last_launch_removed() -> None:
    """What an import made once and a launch's ranks remove at their exit, made again: W&B's media
    directory (without it a later launch's table failed: No such file ... wandb-media/....table.json)."""
    media = sys.modules.get("wandb.sdk.data_types._private")
    if media is not None:
        os.makedirs(media.MEDIA_TMP.name, exist_ok=True)


def _launcher(request: dict) -> int:
    """In the forked launcher: the request's directory, environment and output, then the ranks."""
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        _state_the_last_launch_removed()
        code = launch_ranks(request["nprocs"], request["script"], request["args"])
    except Exception:  # noqa: BLE001 - the launch's failure, told as a launcher would (a rank's SystemExit
        # passes: it leaves through the interpreter, as the ranks of main() do)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        raise SystemExit(main())
