"""Durable, atomic file writes: a temporary file next to the target, fsync, rename, directory fsync.

Readers see the old file or the complete new one, never a part. A new file gets the mode
``open()`` would give it (0666 less the umask), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def new_file_mode() -> int:
    """The mode a newly created file gets: 0o666 less the process umask."""
    umask = os.umask(0o022)  # the only way to read the umask is to set it
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames in ``directory`` durable; not every platform or file system can open a directory."""
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


def temp_file(target: str | os.PathLike) -> tuple[int, Path]:
    """A new empty file (open descriptor, path) in ``target``'s directory, so that renaming it
    over ``target`` is atomic; it has the mode a new file gets."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, new_file_mode())
    return fd, Path(tmp)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` only when the ``with`` block succeeds.

    Writes a temporary file in the same directory, fsyncs it, renames it over ``path``
    (keeping the mode of the file it replaces) and fsyncs the directory. On any error the
    temporary file is removed and ``path`` is untouched.
    """
    target = Path(path)
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    fd, tmp = temp_file(target)
    os.close(fd)
    try:
        with open(tmp, "w+b") as fh:  # by name, so ``fh.name`` is the temporary path
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename, directory fsync)."""
    with atomic_output(path) as fh:
        fh.write(data)
