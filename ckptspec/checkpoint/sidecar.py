"""The sidecar: a checkpoint's complete manifest, ``ckptspec.json`` (or ``.msgpack``) in its tag directory.

It is written last and atomically (``_commit.commit``), so its presence marks a complete checkpoint;
writing one removes a sidecar of the other encoding, so that no stale copy remains.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .._commit import commit
from .._fs import fsync, io_point, temp_file
from ..errors import InputOutputError
from ..format.codec import Encoding, dumps
from ..location import RemotePath, location

if TYPE_CHECKING:
    from ..format.models import Manifest

SIDECAR_NAMES: dict[str, str] = {"json": "ckptspec.json", "msgpack": "ckptspec.msgpack"}


def find_sidecars(tag_dir: str | os.PathLike | RemotePath) -> list[Path | RemotePath]:
    """The sidecars present in a directory (normally none or one)."""
    tag_dir = location(tag_dir)
    return [tag_dir / name for name in SIDECAR_NAMES.values() if (tag_dir / name).is_file()]


def find_sidecar(tag_dir: str | os.PathLike | RemotePath) -> Path | RemotePath | None:
    """The sidecar of a tag directory (``ckptspec.json`` before ``ckptspec.msgpack``), or None."""
    return next(iter(find_sidecars(tag_dir)), None)


def sidecar_commit(
    tag_dir: str | os.PathLike, manifest: Manifest | dict, encoding: Encoding = "json"
) -> tuple[list[tuple[Path, Path]], list[Path]]:
    """The sidecar written to a finished temporary file: (renames, removals) for ``_fs.commit``,
    the removal being a sidecar of the other encoding, so that no stale copy remains."""
    tag_dir = Path(tag_dir)
    target = tag_dir / SIDECAR_NAMES[encoding]
    data = dumps(manifest, encoding)
    fd, tmp = temp_file(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            io_point("write")
            fh.write(data)
            fh.flush()
            fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return [(tmp, target)], [tag_dir / other for other in SIDECAR_NAMES.values() if other != target.name]


def write_sidecar(tag_dir: str | os.PathLike, manifest: Manifest | dict, encoding: Encoding = "json") -> Path:
    """Write the complete manifest next to the shards, atomically, removing a sidecar of the other encoding."""
    try:
        renames, removals = sidecar_commit(tag_dir, manifest, encoding)
        commit(tag_dir, renames, removals)
    except OSError as exc:
        raise InputOutputError(
            "CK906",
            f"cannot write the sidecar: {exc.strerror}",
            "check that the tag directory is writable and the sidecar name is free",
            str(Path(tag_dir) / SIDECAR_NAMES[encoding]),
        ) from None
    return renames[0][1]
