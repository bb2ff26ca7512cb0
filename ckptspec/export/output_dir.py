"""The output directory of a command that builds it whole beside it and then publishes it
(``export``, ``reshard``, ``export-universal``).

The run holds OUTPUT for its whole write (``_fs.exclusive``): a second run into it is refused
(CK908) instead of both "succeeding" with whichever finished last, and what OUTPUT holds is
checked only once it is held. A new OUTPUT is created empty to be held (and removed again if the
run fails). A symlinked OUTPUT is written where it points, as ``reconstruct`` does: the temporary
directory is built beside the target and takes its place; the link stays.

Under a torchrun split (``ckptspec.split``) rank 0 alone holds OUTPUT, makes the temporary directory and puts it
in place once every rank built its share of it; the other ranks write into the directory rank 0 names.

An OUTPUT at a URL (``s3://``, ``gs://``...) is built the same way in a local staging directory (``staged``:
the same writers, so the same bytes), then uploaded by ``location.upload.publish``: the objects under the
directories first, the object readers look for (``latest``, DCP's ``.metadata``) last. It must hold no object
yet (CK909), as a local OUTPUT of these commands must be empty.
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
from ..location import RemotePath, is_remote, location, upload, writable

# The objects that make a directory output visible, uploaded last in this order (the rest of the top-level
# files just before them when there is none of these): DeepSpeed's pointer, a DCP directory's metadata.
VISIBLE_LAST = ("latest_universal", ".metadata", "latest")
_urls: dict[Path, str] = {}  # a staging directory held for a URL -> the URL (``build_and_publish`` uploads it)

T = TypeVar("T")


@contextlib.contextmanager
def held_output(output: str | os.PathLike, what: str) -> Iterator[Path]:
    """Create (if new) and hold OUTPUT for this run; yields the directory to replace (a symlink's target).
    A URL (as given: a ``Path`` would fold ``s3://`` into a local name) is built in a local staging directory and
    uploaded (``staged``, ``build_and_publish``). Another rank than
    0 of a torchrun split only gets the directory: rank 0 holds it for the job."""
    if is_remote(output):
        with staged(os.fspath(output), what) as out:
            yield out
        return
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
        if out in _urls:
            upload.publish(out, _urls[out], visible_last(out))
        return result
    except BaseException as exc:
        import shutil

        share.tell(exc)  # the other ranks stop writing (they get it at their next exchange) before it is removed
        if share.first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged(url: str, what: str, empty: bool = True) -> Iterator[Path]:
    """A local directory (new, empty) that stands for the output at ``url`` while it is built; removed at the end.
    ``empty``: the URL must hold no object (CK909). A torchrun split is refused (CK919): its ranks would build in
    directories of their own."""
    writable(url, what)  # CK916 (HTTP), CK917 before anything is read
    if empty and upload.objects(url):
        raise InputOutputError(
            "CK909",
            "the output URL already holds objects (a killed upload's, without the object readers look for, too)",
            "give a new URL, or remove what is there with your storage's own tool (aws s3 rm --recursive)",
            url,
        )
    if split.current().size > 1:
        raise InputOutputError(
            "CK919",
            f"{what} cannot be written to a URL by a torchrun split: every rank writes its files into one directory",
            "run the command in one process (without torchrun), or write to a file system every node mounts",
            url,
        )
    import shutil
    import tempfile

    base = Path(tempfile.gettempdir())
    sweep(base)  # a killed upload's staging directory: its writer is gone
    stage = temp_dir(base / "ckptspec-upload")
    out = stage / "out"
    out.mkdir()
    _urls[out] = url
    try:
        with exclusive(out) if empty else contextlib.nullcontext():  # reconstruct's writer holds it itself
            yield out
    finally:
        _urls.pop(out, None)
        shutil.rmtree(stage, ignore_errors=True)


def visible_last(directory: Path) -> list[str]:
    """The top-level files of a built output that make it visible, in upload order (``VISIBLE_LAST``)."""
    top = sorted(p.name for p in directory.iterdir() if p.is_file())
    named = [n for n in VISIBLE_LAST if n in top]
    return named or top


def reconstruct_to_url(url: str, tag_dir, write: Callable[[Path], T]) -> T:
    """``reconstruct`` to a URL: ``write(out)`` builds the output in a local staging directory, which is published
    (``upload.publish``) with the index, or the single weights file, last; ckptspec's earlier output there is
    replaced (its objects the new one does not have removed after), a file of an output's name that ckptspec did not
    write is refused first (CK909), as in a local directory."""
    from ..errors import ForeignOutput
    from .outputs import existing_outputs

    if isinstance(tag_dir, RemotePath) and (url.rstrip("/") + "/").startswith(str(tag_dir).rstrip("/") + "/"):
        raise InputOutputError(
            "CK906",
            f"the output is inside the checkpoint's own tag directory {tag_dir}: ckptspec does not write into a "
            "checkpoint it reads",
            "write the weights elsewhere: the save directory above the tag directory, or a directory of their own",
            url,
        )
    with staged(url, "the reconstruction", empty=False) as out:
        previous = existing_outputs(location(url))
        if previous.foreign:
            raise ForeignOutput(f"{url.rstrip('/')}/{previous.foreign[0]}", previous.foreign[0])
        result = write(out)
        index = getattr(result, "index", None)
        visible = [index] if index else list(getattr(result, "files", []))[:1]
        upload.publish(out, url, visible, removals=sorted(previous.ours))
    return result
