"""Ranks that exit when their launcher dies, and the one line a rank started without one prints.

`kill -9` of the `deepspeed` launcher leaves its ranks training: the launcher is two processes
(`deepspeed` runs `python -m deepspeed.launcher.launch`, which starts the ranks), and the killed
one forwards nothing. The orphaned ranks keep MASTER_PORT, so `resume=auto` right after fails
with EADDRINUSE. A daemon thread in each rank polls its parent (and, under DeepSpeed, the
parent's parent) and ends the rank once one is gone, which the kernel shows by re-parenting.

Polling rather than prctl(PR_SET_PDEATHSIG): that signal follows the parent *thread* that
started the rank (a launcher that spawns from a worker thread would kill its ranks when that
thread ends), and it cannot watch the grandparent that `deepspeed` leaves behind.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 0.5
LAUNCHER_GONE_EXIT = 1
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE")  # what torchrun, deepspeed and srun's torchrun set
DEEPSPEED_LAUNCH = "deepspeed.launcher.launch"


def under_launcher() -> bool:
    """Any of the launcher's variables: a plain `python recipes/finetune.py` has none of them."""
    return any(name in os.environ for name in LAUNCHER_ENV)


def launcher_hint(argv: list[str]) -> str:
    """The error line for a rank started by plain `python`: the command that launches it."""
    script = argv[0] if argv else "recipes/finetune.py"
    rest = " ".join(argv[1:]) or "--config RECIPE.yaml"
    return (f"{script} runs its processes under a launcher (it sets RANK, WORLD_SIZE, LOCAL_RANK): run "
            f"`deepspeed --num_gpus N {script} {rest}` (on CPU N processes), or `torchrun --nproc_per_node N ...`")


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` from /proc (Linux), or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the comm field may hold spaces and ")"
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def watched_chain() -> list[tuple[int, int]]:
    """(process, the parent it has now) pairs to watch: this rank, and under DeepSpeed its
    `deepspeed.launcher.launch` parent, whose parent is the `deepspeed` command a user kills."""
    parent = os.getppid()
    chain = [(os.getpid(), parent)]
    grand = _parent_of(parent)
    if grand is not None and DEEPSPEED_LAUNCH in _cmdline(parent):
        chain.append((parent, grand))
    return chain


def _gone(chain: list[tuple[int, int]]) -> int | None:
    """The launcher pid that died, if any: a watched process now has another parent."""
    for pid, parent in chain:
        now = os.getppid() if pid == os.getpid() else _parent_of(pid)
        if now != parent:
            return parent
    return None


def exit_with_launcher(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch (Linux, under a launcher): the rank exits within `poll_s` of its launcher's death."""
    if not sys.platform.startswith("linux") or not under_launcher():
        return None
    chain = watched_chain()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            dead = _gone(chain)
            if dead is not None:
                if os.environ.get("RANK") == "0":
                    print(f"error: the launcher (pid {dead}) is gone: this run's processes exit "
                          "(resume with resume=auto)", file=sys.stderr, flush=True)
                os._exit(LAUNCHER_GONE_EXIT)  # no clean-up: the peers are going too, a collective would hang

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
