"""Several files replaced as one step: the commit of ``reconstruct``, ``embed`` and the sidecar.

A writer of several files holds its directory (``_fs.exclusive``), writes every file under a
temporary name (``_fs.temp_file``), then commits them (``commit``): a journal (``.ckptspec-commit.json``)
lists the renames and removals before any is made, so a run killed half way through them is rolled
forward by the next (``recover``): the directory holds the earlier output or the complete new one,
never a mix. A run stopped there by Ctrl-C or SIGTERM finishes the renames first, and
``commit_outcome`` tells the CLI what a stopped commit left.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from ._fs import JOURNAL, TEMP_RE, fsync_dir, io_point, mark_outcome, replace, write_atomic

__all__ = ["JOURNAL", "commit", "commit_outcome", "recover"]


def commit(directory: str | os.PathLike, renames: list[tuple[Path, Path]], removals: Sequence[Path] = ()) -> None:
    """Rename finished temporaries over their targets and remove superseded files, as one step.

    The journal is written (atomically) before the first rename and removed after the last. If it
    cannot be written, nothing was renamed: the temporaries (and the journal) are removed. A run
    killed after that leaves the journal, for the next ``recover`` in ``directory``; a failing step
    too. Ctrl-C or SIGTERM there finishes the renames (a moment's work) before stopping, rather than
    leave readers a mix. The exception then says which (``commit_outcome``).
    """
    directory = Path(directory)
    plan = {
        "renames": [[tmp.name, final.name] for tmp, final in renames],
        "removals": [path.name for path in removals],
    }
    journal = json.dumps(plan).encode("utf-8")
    try:
        write_atomic(directory / JOURNAL, journal)
    except BaseException:
        for tmp, _ in renames:
            Path(tmp).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            if (directory / JOURNAL).read_bytes() == journal:  # renamed, then its directory fsync failed
                (directory / JOURNAL).unlink()
        raise
    try:
        _roll_forward(directory, plan)
    except BaseException as stopped:
        mark_outcome(stopped, "unfinished", directory)
        if not isinstance(stopped, Exception):  # KeyboardInterrupt, or the CLI's SIGTERM
            with contextlib.suppress(BaseException):  # stopped again: the journal stays
                _roll_forward(directory, plan)
                mark_outcome(stopped, "complete", directory)
        raise


def commit_outcome(exc: BaseException) -> tuple[str, Path] | None:
    """("complete", directory) when ``exc`` stopped a commit that was finished before it went on,
    ("unfinished", directory) when the journal stays for the next writer; else None."""
    return getattr(exc, "ckptspec_commit", None) or getattr(exc.__cause__, "ckptspec_commit", None)


def recover(directory: str | os.PathLike) -> bool:
    """Finish the commit a killed run left in ``directory``; True when there was one to finish."""
    directory = Path(directory)
    try:
        plan = json.loads((directory / JOURNAL).read_text("utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        plan = {"renames": [], "removals": []}  # cut off before it was complete: nothing was renamed
    _roll_forward(directory, plan)
    return True


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _roll_forward(directory: Path, plan: dict) -> None:
    # Only this directory's own temporaries and plain names: a journal is input too.
    for tmp, final in plan.get("renames", []):
        if _plain(tmp) and _plain(final) and TEMP_RE.match(tmp) and (directory / tmp).exists():
            replace(directory / tmp, directory / final)  # a missing one was renamed before the kill
    for name in plan.get("removals", []):
        if _plain(name):
            io_point("remove")
            (directory / name).unlink(missing_ok=True)
    fsync_dir(directory)
    io_point("remove")
    (directory / JOURNAL).unlink(missing_ok=True)
    fsync_dir(directory)
