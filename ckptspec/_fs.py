"""Durable, atomic file writes that a killed run cannot leave half done.

Every file ckptspec writes goes to a temporary name next to its target, is fsynced and renamed
over the target (then the directory is fsynced): readers see the old file or the complete new
one, never a part. A new file gets the mode ``open()`` would give it (0666 less the umask). A
symlink is written through; a FIFO or character device is written in place (``write_atomic``).

Temporary names say whose they are: ``.<target>.ckptspec-<host>-<pid>-<random>.tmp`` (a temporary
directory: the same without ``.tmp``). A run that was killed (SIGKILL, out of memory, a lost node)
leaves its temporaries behind; the next ckptspec write in that directory removes those of a
process of this host that no longer exists (``sweep``), and never those of a live writer or of
another host, whose liveness it cannot see. ``leftovers`` lists them all (``validate DIR`` warns).

Writers of several files (``reconstruct``, ``embed``) hold ``exclusive(directory)`` for the whole
write: a second run into the same directory is refused (CK908) instead of mixing its files with
the first's; they commit their files together through a journal (``_commit``).

``io_point`` marks each step of a write (create, write, fsync, rename, remove). It does nothing
unless ``CKPTSPEC_FAILPOINT`` is set, which only the crash-injection tests do: ``kill:N``,
``term:N`` and ``int:N`` send SIGKILL, SIGTERM or SIGINT to this process at the N-th step,
``enospc:N`` raises a full-disk error there, and ``count:FILE`` writes the number of steps to
FILE at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import InputOutputError, OutputBusy

_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
TEMP_RE = re.compile(r"^\.(?P<target>.+)\.ckptspec-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[A-Za-z0-9_]+(?:\.tmp)?$")


# --------------------------------------------------------------------------- failure injection (tests)

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}
# Read at the first step, not at import, so a process forked after the import has its own.
_FAILPOINT: str | None = None
_steps = 0


def _armed() -> str:
    global _FAILPOINT
    if _FAILPOINT is None:
        _FAILPOINT = os.environ.get("CKPTSPEC_FAILPOINT", "")
        if _FAILPOINT.startswith("count:"):
            counter = Path(_FAILPOINT.removeprefix("count:"))
            atexit.register(lambda: counter.write_text(str(_steps)))
    return _FAILPOINT


def io_point(what: str) -> None:
    """One step of a write; see the module docstring (a no-op unless CKPTSPEC_FAILPOINT is set)."""
    global _steps
    failpoint = _armed()
    if not failpoint:
        return
    _steps += 1
    mode, _, arg = failpoint.partition(":")
    if mode in _SIGNALS and _steps == int(arg):
        os.kill(os.getpid(), _SIGNALS[mode])
    elif mode == "enospc" and _steps == int(arg):
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {what})")


# --------------------------------------------------------------------------- temporaries


def _umask() -> int:
    umask = os.umask(0o022)  # the only way to read the umask is to set it
    os.umask(umask)
    return umask


def new_file_mode() -> int:
    """The mode a newly created file gets: 0o666 less the process umask."""
    return 0o666 & ~_umask()


def _prefix(target: Path) -> str:
    return f".{target.name}.ckptspec-{_HOST}-{os.getpid()}-"


def temp_file(target: str | os.PathLike) -> tuple[int, Path]:
    """A new empty file (open descriptor, path) in ``target``'s directory, so that renaming it
    over ``target`` is atomic; named as this run's temporary, with the mode a new file gets."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(target), suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, new_file_mode())
        io_point("create")
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


def temp_dir(target: str | os.PathLike) -> Path:
    """A new empty directory beside ``target``, named as this run's temporary, with the mode ``mkdir``
    would give it (0o777 less the umask): it is published under ``target``'s name once complete."""
    target = Path(target)
    path = Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))
    try:
        os.chmod(path, 0o777 & ~_umask())  # mkdtemp's 0o700 would hide the output from the group and others
        io_point("create")
    except BaseException:
        path.rmdir()
        raise
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def leftovers(directory):
    """Every ckptspec temporary in ``directory`` (live writers' and stale ones, any host); a directory
    that is not local (``location.RemotePath``) is listed through its own ``iterdir``."""
    if not isinstance(directory, (str, os.PathLike)):
        return [path for path in directory.iterdir() if is_leftover(path.name)]
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [Path(directory) / name for name in names if is_leftover(name)]


def is_leftover(name: str) -> bool:
    """A ckptspec temporary or an unfinished commit's journal, by its name."""
    return bool(TEMP_RE.match(name)) or name == JOURNAL


def mark_outcome(stopped: BaseException, state: str, where: Path) -> None:
    """Say on the exception that stopped a write what it left (``_commit.commit_outcome`` reads it)."""
    stopped.ckptspec_commit = (state, where)  # type: ignore[attr-defined]  # rides on any exception, whatever its class


def is_stale(path: str | os.PathLike) -> bool:
    """A temporary of a process of this host that no longer runs (so nobody will finish it)."""
    m = TEMP_RE.match(Path(path).name)
    return m is not None and m["host"] == _HOST and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"]))


def sweep(directory: str | os.PathLike) -> list[Path]:
    """Remove the stale temporaries of killed runs in ``directory``; returns what was removed."""
    removed = []
    for path in leftovers(directory):
        if not is_stale(path):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        io_point("remove")
        removed.append(path)
    return removed


@contextlib.contextmanager
def exclusive(directory: str | os.PathLike) -> Iterator[None]:
    """Hold ``directory`` for this run's writes; a second ckptspec writer there is refused (CK908).

    An advisory lock on the directory itself (no lock file to leave behind), released when the
    process ends however it ends. File systems that cannot lock a directory are written unlocked.
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusy(str(directory)) from None
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- directories


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the platform or file system cannot, and nothing was changed."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    io_point("rename")
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), os.fspath(a))


def publish_dir(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the finished directory ``tmp`` in the place of ``target`` (which may exist): atomically
    where the system can swap directories, else by two renames (a run killed between them leaves
    no ``target``, and the old one under a temporary name). It keeps the mode of a ``target`` it replaces."""
    tmp, target = Path(tmp), Path(target)
    if not target.exists():
        replace(tmp, target)
    else:
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        if not exchange(tmp, target):
            old = temp_dir(target)
            old.rmdir()
            replace(target, old)
            replace(tmp, target)
            tmp = old
    # ``tmp`` now holds what ``target`` held.
    fsync_dir(target.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    io_point("remove")


# --------------------------------------------------------------------------- durable writes


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames in ``directory`` durable; not every platform or file system can open a directory."""
    io_point("fsync")
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename a finished temporary over its target (one step of a write)."""
    io_point("rename")
    os.replace(tmp, target)


def fsync(fd: int) -> None:
    io_point("fsync")
    os.fsync(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` only when the ``with`` block succeeds.

    Writes a temporary file in the same directory (removing the stale ones of killed runs
    first), fsyncs it, renames it over ``path`` (keeping the mode of the file it replaces)
    and fsyncs the directory. On any error the temporary file is removed and ``path`` is
    untouched. A symlink is written through: its target is replaced, beside which the
    temporary goes, and the link stays.
    """
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    sweep(target.parent)
    fd, tmp = temp_file(target)
    os.close(fd)
    try:
        with open(tmp, "w+b") as fh:  # by name, so ``fh.name`` is the temporary path
            yield fh
            fh.flush()
            fsync(fh.fileno())
        os.chmod(tmp, mode)
        replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fsync_dir(target.parent)
    except BaseException as stopped:  # the new file is in place: say so (``_commit.commit_outcome``)
        mark_outcome(stopped, "complete", target)
        raise


_NOT_WRITABLE = {stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket", stat.S_IFBLK: "a block device"}


def _written_in_place(path: str | os.PathLike) -> bool:
    """Whether ``path`` (or what its symlink names) is a FIFO or a character device (a pipe, a terminal,
    /dev/null): renaming a file over one would replace it, so it is opened and written instead. A
    regular file or a new name is not; a directory, socket or block device is refused (CK906)."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except FileNotFoundError:
        return False  # a new file (or a dangling symlink's target)
    if kind in _NOT_WRITABLE:
        raise InputOutputError(
            "CK906",
            f"cannot write: it is {_NOT_WRITABLE[kind]}",
            "name a file (new or existing), a FIFO or a character device; or - for standard output",
            os.fspath(path),
        )
    return kind in (stat.S_IFIFO, stat.S_IFCHR)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename, directory fsync); a FIFO or
    character device is written in place, as a shell's ``>`` does (``_written_in_place``)."""
    if _written_in_place(path):
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_NOCTTY), "wb") as fh:  # blocks until a FIFO has a reader
            io_point("write")
            fh.write(data)  # a device's error (/dev/full: ENOSPC) is raised here or at close
        return
    with atomic_output(path) as fh:
        io_point("write")
        fh.write(data)


# --------------------------------------------------------------------------- several files at once

JOURNAL = ".ckptspec-commit.json"  # an unfinished commit's (``_commit``)
