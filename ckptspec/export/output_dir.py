"""The output directory of a command that builds it whole beside it and then publishes it
(``export``, ``reshard``, ``export-universal``).

The run holds OUTPUT for its whole write (``_fs.exclusive``): a second run into it is refused
(CK908) instead of both "succeeding" with whichever finished last, and what OUTPUT holds is
checked only once it is held. A new OUTPUT is created empty to be held (and removed again if the
run fails). A symlinked OUTPUT is written where it points, as ``reconstruct`` does: the temporary
directory is built beside the target and takes its place; the link stays.

Under a torchrun split (``ckptspec.split``) rank 0 alone holds OUTPUT, makes the temporary directory and puts it
in place once every rank built its share of it; the other ranks write into the directory rank 0 names.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from .. import split
from .._fs import exclusive, publish_dir, sweep, temp_dir
from ..errors import InputOutputError
from ..location import refuse_write

T = TypeVar("T")


@contextlib.contextmanager
def held_output(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """Create (if new) and hold OUTPUT for this run; yields the directory to replace (a symlink's target).
    A URL is refused first (CK916; as given: a ``Path`` would fold ``s3://`` into a local name). Another rank than
    0 of a torchrun split only gets the directory: rank 0 holds it for the job."""
    refuse_write(output, what)
    out = Path(os.path.realpath(output))
    if not split.current().first:
        yield out
        return
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
        if split.current().first and any(out.iterdir()):
            raise InputOutputError(
                "CK909", "the output exists and is not empty", "give a new directory", os.fspath(output)
            )
        yield out


def build_and_publish(out: Path, build: Callable[[Path], T]) -> T:
    """``build(tmp)`` fills a temporary directory beside the held ``out``, which then takes ``out``'s
    place in one step (``_fs.publish_dir``); on any error the temporary directory is removed.
    Returns what ``build`` returned. Under a torchrun split every rank builds (its files) in rank 0's directory,
    which rank 0 puts in place once every rank is done; on any rank's error, rank 0 removes it once every rank
    stopped writing."""
    share = split.current()

    def make() -> Path:
        sweep(out.parent)  # a killed run's temporary directory beside OUTPUT: its writer is gone
        return temp_dir(out)

    tmp = share.from_first(make)
    try:
        if not tmp.is_dir():  # a rank on another node, OUTPUT on a disk of rank 0's
            raise InputOutputError(
                "CK919",
                f"rank {share.rank} cannot see the temporary directory rank 0 made for the output",
                "every rank writes its files into OUTPUT: give a directory on a file system every node mounts",
                str(out),
            )
        result = build(tmp)
        share.first_only(lambda: publish_dir(tmp, out))
        return result
    except BaseException as exc:
        import shutil

        share.tell(exc)  # the other ranks stop writing (they get it at their next exchange) before it is removed
        if share.first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
