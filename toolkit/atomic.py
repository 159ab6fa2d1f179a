"""Write a result directory under a temporary name and rename it into place when complete, so
that a crash (even kill -9) never leaves a directory that looks finished.

Also the rules every command that writes output shares: an output never overlaps an input,
only one process writes a given output at a time, a result never replaces a directory that
appeared meanwhile, and a full disk is reported in one line with the partial output removed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from toolkit.errors import ToolkitError

# Fault injection for tests: TOOLKIT_FAULT_PAUSE="<point>[@N]:<flag file>" makes the process
# create the flag file and wait the N-th time (default 1st) it reaches <point>, so a test can
# act at a known moment instead of guessing a time: kill -9 it, or delete the flag file to let
# it continue.
FAULT_ENV = "TOOLKIT_FAULT_PAUSE"
FAULT_PAUSE_SECONDS = 600
FAULT_POLL_SECONDS = 0.05
FAULT_EXIT_CODE = 86
_hits: dict[str, int] = {}

# renameat2(2) flag: fail with EEXIST instead of replacing the destination (linux/fs.h).
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How torch's C++ writer and safetensors' Rust writer word an ENOSPC they wrap.
_DISK_FULL_TEXTS = ("No space left on device", "os error 28")


def fault_point(name: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    point, _, flag = spec.partition(":")
    point, _, nth = point.partition("@")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    flag_file = Path(flag)
    flag_file.write_text(str(os.getpid()))
    deadline = time.monotonic() + FAULT_PAUSE_SECONDS  # bounded, so a forgotten pause leaks nothing for long
    while flag_file.exists():
        if time.monotonic() > deadline:
            os._exit(FAULT_EXIT_CODE)
        time.sleep(FAULT_POLL_SECONDS)


def refuse_output_overlapping_inputs(out: str | os.PathLike, *inputs: str | os.PathLike | None) -> None:
    """Refuse an output path that is, contains, or lies inside any input (symlinks resolved).

    Call it before anything is written or deleted: replacing such an output (--overwrite, or a
    run directory's cleanup) would destroy the input. `None` inputs are skipped.
    """
    target = Path(out).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if target == source or source.is_relative_to(target) or target.is_relative_to(source):
            raise ToolkitError(
                f"output {out} overlaps the input {given} (it is, contains or lies inside it once symlinks are "
                "resolved): writing it could destroy the input; choose an output outside the input"
            )


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
    if final.is_symlink() and not final.exists():
        raise ToolkitError(f"output {final} is a symbolic link to {os.readlink(final)}, which does not exist: "
                           "remove the link or create the directory it names")
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
def exclusive_writer(final: Path):
    """Hold an exclusive lock on `final` (a `.name.lock` file next to it) while writing it.

    flock is released by the kernel when the process dies, so kill -9 leaves no stale lock; the
    file is removed on release, and a waiter that locked a removed file retries.
    """
    lock_path = final.parent / f".{final.name}.lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ToolkitError(f"cannot create {lock_path} (the lock that keeps two writers apart): {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ToolkitError(f"another process (pid {holder}) is writing {final}: wait for it to finish, "
                               "or choose another output") from None
        if _still_names(lock_path, fd):
            break
        os.close(fd)
    try:
        _record_holder(fd)
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        os.close(fd)


def _record_holder(fd: int) -> None:
    """Our pid in the lock file, for the other writer's message (informational: a full disk may refuse it)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass


def _still_names(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(final: Path, needed_bytes: int | None) -> None:
    if needed_bytes is None:
        return
    free = shutil.disk_usage(final.parent).free
    if needed_bytes > free:
        raise ToolkitError(f"{final} needs about {human_bytes(needed_bytes)} but only {human_bytes(free)} is free on "
                           f"the file system holding {final.parent}: free space or choose another output")


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when torch or safetensors re-raised it as their own exception type."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def atomic_directory(final: str | os.PathLike, overwrite: bool = False, needed_bytes: int | None = None):
    """Yield a fresh temporary directory next to `final`; on success rename it to `final`.

    One writer at a time (see exclusive_writer). With `needed_bytes`, refuse up front when the
    file system has less free space. A result never replaces a directory that appeared while it
    was being built. With overwrite, the old directory is swapped out in two renames (old ->
    .name.old-PID, new -> name) and then deleted; a crash between the two renames leaves the old
    copy under .name.old-PID and no `final`, never a mixture.
    """
    final = Path(final).absolute()
    _roll_back_interrupted_swap(final)
    check_destination(final, overwrite)
    final = final.resolve()  # a symlink to a directory: write where it points, keep the link
    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_writer(final):
        check_destination(final, overwrite)  # again: a writer that held the lock may have finished
        check_free_space(final, needed_bytes)
        fault_point("after-space-check")
        _remove_stale_partials(final.parent, final.name)
        tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            yield tmp
            fault_point("before-rename")
            _publish(tmp, final, overwrite)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e):
                raise _disk_full_error(final, needed_bytes) from e
            raise


def _disk_full_error(final: Path, needed_bytes: int | None) -> ToolkitError:
    needed = f"needs about {human_bytes(needed_bytes)}" if needed_bytes else "needs more space"
    free = human_bytes(shutil.disk_usage(final.parent).free)
    return ToolkitError(f"no space left on the device while writing {final}: the output {needed}, {free} is free "
                        "now that the partial output was removed; free space or choose another output")


def _publish(tmp: Path, final: Path, overwrite: bool) -> None:
    if final.is_dir() and not any(final.iterdir()):
        try:
            final.rmdir()  # an empty directory the user made is ours to fill
        except OSError:
            pass  # filled meanwhile: the no-replace rename below refuses it
    if not (overwrite and final.exists()):
        rename_no_replace(tmp, final)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    os.rename(final, old)
    fault_point("between-renames")
    rename_no_replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def rename_no_replace(src: Path, dst: Path) -> None:
    """os.rename that never replaces `dst`: renameat2(RENAME_NOREPLACE) where the kernel and file
    system have it; elsewhere plain rename, which cannot replace a non-empty directory either."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    code = -1 if renameat2 is None else renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                                                 _RENAME_NOREPLACE)
    err = ctypes.get_errno() if code else 0
    if renameat2 is None or err in (errno.EINVAL, errno.ENOSYS):
        try:
            os.rename(src, dst)
            return
        except OSError as e:
            err = e.errno
    if err in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
        raise ToolkitError(f"{dst} appeared while this command was writing it (another program created it); "
                           "nothing was replaced: remove it or choose another output, then run again")
    if err:
        raise OSError(err, os.strerror(err), str(dst))


def write_file(path: str | os.PathLike, content: str | bytes, *inputs: str | os.PathLike | None, mode: int | None = None) -> Path:
    """Write a small output file whole or not at all: refuse an output over one of the command's
    `inputs`, write a temporary sibling, then rename it into place."""
    path = Path(path)
    refuse_output_overlapping_inputs(path, *inputs)
    if path.is_dir():
        raise ToolkitError(f"output {path} is a directory: give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
        data = content.encode() if isinstance(content, str) else content
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except OSError as e:
        Path(path.parent / f".{path.name}.partial-{os.getpid()}").unlink(missing_ok=True)
        raise ToolkitError(f"cannot write {path}: {e.strerror or e}") from None
    return path
