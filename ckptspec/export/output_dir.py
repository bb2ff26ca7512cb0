"""The output directory of a command that builds it whole beside it and then publishes it
(``export``, ``reshard``, ``export-universal``).

The run holds OUTPUT for its whole write (``_fs.exclusive``): a second run into it is refused
(CK908) instead of both "succeeding" with whichever finished last, and what OUTPUT holds is
checked only once it is held. A new OUTPUT is created empty to be held (and removed again if the
run fails). A symlinked OUTPUT is written where it points, as ``reconstruct`` does: the temporary
directory is built beside the target and takes its place; the link stays.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from .._fs import exclusive, publish_dir, sweep, temp_dir
from ..errors import InputOutputError
from ..location import refuse_write

T = TypeVar("T")


@contextlib.contextmanager
def held_output(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """Create (if new) and hold OUTPUT for this run; yields the directory to replace (a symlink's target).
    A URL is refused first (CK916; as given: a ``Path`` would fold ``s3://`` into a local name)."""
    refuse_write(output, what)
    out = Path(os.path.realpath(output))
    created = _first_missing(out)  # what a run that fails removes again: OUTPUT and the parents it made
    try:
        out.mkdir(parents=True)
    except FileExistsError:  # a directory (another run's new one, too), or a file
        created = None
        if not out.is_dir():
            raise InputOutputError(
                "CK909", "the output exists and is not a directory", "give a new directory", os.fspath(output)
            ) from None
    with exclusive(out):  # CK908 before anything is looked at or written
        try:
            yield out
        except BaseException:
            if created is not None:
                _remove_empty(out, created)
            raise


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: ``path`` exists)."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def _remove_empty(path: Path, up_to: Path) -> None:
    """Remove ``path`` and its parents up to ``up_to`` while they are empty: the output of a run that
    failed after publishing stays, and so does a folder another writer put something into."""
    with contextlib.suppress(OSError):
        while True:
            path.rmdir()
            if path == up_to:
                return
            path = path.parent


@contextlib.contextmanager
def held_new_output(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """``held_output`` for a command that writes a new directory, never into one that holds anything (CK909)."""
    with held_output(output, what) as out:
        if any(out.iterdir()):
            raise InputOutputError(
                "CK909", "the output exists and is not empty", "give a new directory", os.fspath(output)
            )
        yield out


def build_and_publish(out: Path, build: Callable[[Path], T]) -> T:
    """``build(tmp)`` fills a temporary directory beside the held ``out``, which then takes ``out``'s
    place in one step (``_fs.publish_dir``); on any error the temporary directory is removed.
    Returns what ``build`` returned."""
    sweep(out.parent)  # a killed run's temporary directory beside OUTPUT: its writer is gone
    tmp = temp_dir(out)
    try:
        result = build(tmp)
        publish_dir(tmp, out)
        return result
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
