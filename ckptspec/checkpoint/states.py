"""Decoded torch files, each read once: the one caller of ``read_pt_metadata``.

One command reads a tag directory's ``.pt`` files in several steps: describing the
directory, the CK2xx checks, the embedded-copy check, the reconstruction plan, embedding.
A ``StateCache`` keeps each file's decoded ``data.pkl`` and zip member map, so every step
after the first reuses them. A file that cannot be read is CK204 (its pickle wants to run
code) or CK205 (empty, truncated, not a torch file), with one hint each, here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._forked import Forked
from ..errors import (  # noqa: F401 (the hints: re-exported, where callers have always found them)
    DAMAGED_HINT,
    LEGACY_HINT,
    OVER_CAP_HINT,
    UNSAFE_HINT,
    FileUnreadable,
    InvalidCheckpoint,
    TorchFileError,
)
from ..location import AnyPath, RemotePath, location
from . import prescan, torchfile


def code_and_hint(error: TorchFileError) -> tuple[str, str]:
    """CK204 for a pickle that wants to run code, CK202 for torch's legacy serialization (a
    checkpoint format 1.x cannot describe, not a damaged one), CK225 for a data.pkl over the
    reader's cap (maybe sound, only large), CK205 for anything else unreadable: each class of
    ``TorchFileError`` carries its code and hint (``ckptspec.errors``)."""
    return error.code, error.hint


def unreadable(error: TorchFileError, file: AnyPath | None = None) -> InvalidCheckpoint:
    """The exception for a file that cannot be read (exit 1), naming ``file`` (default: the error's)."""
    code, hint = code_and_hint(error)
    where = file if file is not None else error.path
    return InvalidCheckpoint(code, error.reason, hint, None if where is None else str(where))


@dataclass
class Loaded:
    """What reading one file gave: its decoded state (and zip members when asked), or the error."""

    state: Any = None
    members: dict[str, tuple[int, int]] | None = None
    error: TorchFileError | None = None


class States(Protocol):
    """What a describer reads of a tag directory's files: a ``StateCache``, or the save hook's
    ``SavedStates`` (deepspeed/save/captured_state.py: the files of one save, some from their live state)."""

    def state(self, path: AnyPath) -> Any: ...

    def members(self, path: AnyPath) -> dict[str, tuple[int, int]]: ...


class StateCache:
    """Decoded ``data.pkl`` and zip member maps by file, each read at most once.

    ``load`` raises only when the bytes cannot be had at all (CK901, CK91x); a file that cannot be
    decoded gives a ``Loaded`` with its error;
    ``state`` and ``members`` raise CK204/CK205 (``InvalidCheckpoint``) instead.
    """

    def __init__(self) -> None:
        self._files: dict[Path | RemotePath, Loaded] = {}
        self._keys: dict[AnyPath, Path | RemotePath] = {}

    def _key(self, path: AnyPath) -> Path | RemotePath:
        """The file ``path`` names, resolved once per name: a describer asks for the same file once per
        parameter, and each ``resolve`` is an ``lstat`` of every component (docs/performance.md)."""
        key = self._keys.get(path)
        if key is None:
            key = self._keys[path] = location(path).resolve()
        return key

    def load(self, path: AnyPath, *, members: bool = False) -> Loaded:
        """The file's state, and its zip members when ``members`` (an error in either makes it unreadable).

        A file that cannot be read at all raises ``FileUnreadable`` (CK901; a remote one ``RemoteError``),
        exit 2: it is not a damaged file.
        """
        key = self._key(path)
        loaded = self._files.get(key)
        if loaded is None:
            try:
                loaded = Loaded(state=torchfile.read_pt_metadata(path))
            except TorchFileError as exc:
                loaded = Loaded(error=exc)
            except OSError as exc:  # an I/O error, not a damaged file: CK901, exit 2
                raise FileUnreadable(path, exc) from None
            self._files[key] = loaded
        if members and loaded.error is None and loaded.members is None:
            try:
                loaded.members = torchfile.zip_member_locations(path)
            except TorchFileError as exc:
                loaded.state, loaded.error = None, exc
            except OSError as exc:
                raise FileUnreadable(path, exc) from None
        return loaded

    def load_all(self, paths: list, meanwhile: Callable[[], object] | None = None) -> None:
        """Read the files not read yet, each unpickled behind a forked process's opcode walk
        (``prescan``), and a large one's tree checked by another forked process while the files
        after it are unpickled (``_check_apart``): what ``load`` of each would give, sooner on a
        machine with a second core. ``meanwhile``: see ``prescan.scan_all`` (work run while the
        other process walks)."""
        raws, keys = [], []
        for path in paths:
            key = self._key(path)
            if key in self._files or key in keys:
                continue
            try:
                raws.append(torchfile.read_data_pkl(path))
                keys.append(key)
            except TorchFileError as exc:
                self._files[key] = Loaded(error=exc)
            except OSError as exc:
                raise FileUnreadable(path, exc) from None
        with ExitStack() as children:
            apart = []  # (index, tree, the process checking it): no tree is used before its check passes
            for i, scan_error in prescan.scan_all([raw.data for raw in raws], meanwhile):
                try:
                    tree = torchfile.unpickle_data_pkl(raws[i], scan_error)
                    if i < len(raws) - 1 and len(raws[i].data) >= CHECK_APART_BYTES:
                        apart.append((i, tree, children.enter_context(_check_apart(raws[i], tree))))
                        continue
                    torchfile.check_decoded(raws[i], tree)
                    self._files[keys[i]] = Loaded(state=tree)
                except TorchFileError as exc:
                    self._files[keys[i]] = Loaded(error=exc)
            for i, tree, child in apart:
                try:
                    _checked_apart(raws[i], tree, child)
                    self._files[keys[i]] = Loaded(state=tree)
                except TorchFileError as exc:
                    self._files[keys[i]] = Loaded(error=exc)

    def forget_members(self, path: str | os.PathLike) -> None:
        """Read the zip directory of ``path`` again when next asked: the file was rewritten with the
        same tensors (an added item moves every member, ``pt_rewrite``), so its decoded state stays."""
        loaded = self._files.get(self._key(path))
        if loaded is not None:
            loaded.members = None

    def state(self, path: AnyPath) -> Any:
        """The decoded top-level object (tensors as ``TensorRef``); raises CK204/CK205."""
        loaded = self.load(path)
        if loaded.error is not None:
            raise unreadable(loaded.error, path)
        return loaded.state

    def members(self, path: AnyPath) -> dict[str, tuple[int, int]]:
        """Zip member name -> (data offset, size); raises CK204/CK205."""
        loaded = self.load(path, members=True)
        if loaded.error is not None:
            raise unreadable(loaded.error, path)
        assert loaded.members is not None  # load(members=True) read them, or set the error
        return loaded.members


# Below this a tree's check ends before a process would start: no process.
CHECK_APART_BYTES = 8 * 1024 * 1024


def _check_apart(raw: torchfile.RawPickle, tree: Any) -> Forked:
    """A forked process running ``check_decoded`` on ``tree``; it sends back the refusal's reason
    as JSON (null: the tree passed)."""

    def work() -> bytes:
        try:
            torchfile.check_decoded(raw, tree)
        except TorchFileError as exc:
            return json.dumps(exc.reason).encode()
        return b"null"

    return Forked(work)


def _checked_apart(raw: torchfile.RawPickle, tree: Any, child: Forked) -> None:
    """What ``check_decoded(raw, tree)`` raises, as the child found it; checked here when there
    was no child or it failed."""
    sent = child.result()
    reason = None if sent is None else json.loads(sent)
    if sent is None or not (reason is None or isinstance(reason, str)):
        torchfile.check_decoded(raw, tree)
    elif reason is not None:
        raise TorchFileError(raw.path, reason)


def read_state(path: AnyPath) -> Any:
    """One file's decoded state, read now (no cache); raises CK204/CK205."""
    return StateCache().state(path)
