"""Write a result directory under a temporary name and rename it into place when complete, so
that a crash (even kill -9) never leaves a directory that looks finished."""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import ToolkitError

# Fault injection for tests: TOOLKIT_FAULT_PAUSE="<point>[@N]:<flag file>" makes the process
# create the flag file and sleep the N-th time (default 1st) it reaches <point>, so a test can
# kill -9 it at a known moment instead of guessing a time.
FAULT_ENV = "TOOLKIT_FAULT_PAUSE"
FAULT_PAUSE_SECONDS = 600
FAULT_EXIT_CODE = 86
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    point, _, flag = spec.partition(":")
    point, _, nth = point.partition("@")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    Path(flag).write_text(str(os.getpid()))
    time.sleep(FAULT_PAUSE_SECONDS)  # bounded, so a test that forgets to kill us leaks nothing for long
    os._exit(FAULT_EXIT_CODE)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(parent: Path, name: str) -> None:
    for path in parent.glob(f".{name}.partial-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _roll_back_interrupted_swap(final: Path) -> None:
    """An --overwrite killed between its two renames left the old result at .name.old-PID and no
    `final`: put it back, as if that run had never started (it had not replaced anything yet)."""
    if final.exists() or final.is_symlink():
        return
    for old in sorted(final.parent.glob(f".{final.name}.old-*")):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            os.rename(old, final)
            return


def check_destination(final: Path, overwrite: bool) -> None:
    """Fail early, before any work, if `final` can't be (re)written."""
    if final.exists() and not final.is_dir():
        raise ToolkitError(f"output {final} exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise ToolkitError(f"output directory {final} exists and is not empty (use --overwrite to replace it)")
    for parent in final.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ToolkitError(f"cannot create {final}: {parent} is not a directory")
            if not os.access(parent, os.W_OK):
                raise ToolkitError(f"cannot create {final}: {parent} is not writable")
            break


@contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary directory next to `final`; on success rename it to `final`.

    With overwrite, the old directory is swapped out in two renames (old -> .name.old-PID,
    new -> name) and then deleted; a crash between the two renames leaves the old copy under
    .name.old-PID and no `final`, never a mixture.
    """
    final = Path(final).absolute()
    _roll_back_interrupted_swap(final)
    check_destination(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(final.parent, final.name)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fault_point("before-rename")
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path) -> None:
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    os.rename(final, old)
    fault_point("between-renames")
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
