"""Manifest file paths: the one rule for a path that stays inside the checkpoint directory (CK113).

The rule is about the path **as the manifest writes it**: relative, no drive, no ``..``, ``.``
or empty part, no NUL (``\\`` counts as a separator). Where the named file leads on disk is
not part of it: a shard may be a symbolic link to a file elsewhere, as in the Hugging Face hub
cache (``snapshots/<rev>/FILE -> ../../blobs/<sha256>``), DVC, git-annex or a deduplicating
store. Whoever wrote the directory chose those links; a manifest can only choose names in it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    from ..location import RemotePath

_Root = TypeVar("_Root", bound="Path | RemotePath")  # a local tag directory, or one at a URL

_DRIVE = re.compile(r"^[A-Za-z]:")


def parts(path: str) -> list[str]:
    """The parts of a manifest path; ``\\`` counts as a separator."""
    return path.replace("\\", "/").split("/")


def stays_inside(path: str) -> bool:
    """True when ``path`` is a plain relative path: it cannot name anything outside its directory."""
    split = parts(path)
    return not (
        path.startswith(("/", "\\")) or _DRIVE.match(path) or any(p in ("", ".", "..") for p in split) or "\x00" in path
    )


def join_inside(root: _Root, path: str) -> _Root | None:
    """The file ``path`` names below ``root``, or None when the path could leave it (CK113).

    The result is not resolved: a symbolic link is followed when the file is opened, like
    any other file of the directory.
    """
    return cast(_Root, root.joinpath(*parts(path))) if stays_inside(path) else None  # the root's own type
