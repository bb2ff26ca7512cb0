"""A file or directory at a URL, with the part of ``pathlib.Path``'s API the readers use."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from .problems import not_found

if TYPE_CHECKING:
    from .store import _Store


@dataclass(frozen=True)
class _Stat:
    st_size: int


class RemotePath:
    """A file or directory at a URL, with the part of ``pathlib.Path``'s API the readers use.

    ``str()`` is the URL. No ``__fspath__``: a remote path is never opened as a local file by mistake.
    """

    __slots__ = ("_store", "path")

    def __init__(self, store: _Store, path: str):
        self._store = store
        self.path = path

    # -- names ---------------------------------------------------------------------------

    def __str__(self) -> str:
        return self._store.url(self.path)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other._store is self._store and other.path == self.path

    def __hash__(self) -> int:
        return hash((id(self._store), self.path))

    def __lt__(self, other: RemotePath) -> bool:
        return self.path < other.path

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def parent(self) -> RemotePath:
        root = self._store.root_of(self.path)
        head = self.path.rsplit("/", 1)[0]
        return RemotePath(self._store, head if "/" in self.path and len(head) >= len(root) else self.path)

    def __truediv__(self, name: str) -> RemotePath:
        return self.joinpath(name)

    def joinpath(self, *parts: str) -> RemotePath:
        path = self.path
        for part in parts:
            for piece in str(part).split("/"):
                if piece:
                    path = f"{path}/{piece}"
        return RemotePath(self._store, path)

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        if not self.is_relative_to(other):
            raise ValueError(f"{self} is not below {other}")
        return PurePosixPath(self.path[len(other.path) + 1 :] or ".")

    def is_relative_to(self, other: RemotePath) -> bool:
        return isinstance(other, RemotePath) and (self.path == other.path or self.path.startswith(other.path + "/"))

    def as_posix(self) -> str:
        return str(self)

    def resolve(self) -> RemotePath:
        return self

    # -- what is there -------------------------------------------------------------------

    def _info(self) -> dict | None:
        return self._store.info(self.path)

    def exists(self) -> bool:
        return self._known("file") or self._known("directory")

    def is_file(self) -> bool:
        return self._known("file")

    def is_dir(self) -> bool:
        return self._known("directory")

    def _known(self, kind: str) -> bool:
        # Below a directory known as such, its listing (one request for every entry) answers.
        parent, _, name = self.path.rpartition("/")
        listed = self._store._listings.get(parent)
        if listed is None and parent and self._store.known_dir(parent):
            listed = self._store.listing(parent)
        if listed is not None:
            entry = listed.get(name)
            # An HTTP index page hides dot files (nginx's autoindex, Apache's): one not listed is asked of the server.
            if entry is not None or not (self._store.http and name.startswith(".")):
                return entry is not None and entry.get("type") == kind
        info = self._info()
        return info is not None and info.get("type") == kind

    def stat(self) -> _Stat:
        info = self._info()
        if info is None:
            raise not_found(str(self))
        if info.get("size") is None:
            handle = self._store.handle(self.path)
            return _Stat(int(handle.size if handle.size is not None else 0))
        return _Stat(int(info["size"]))

    def iterdir(self) -> Iterator[RemotePath]:
        for name in sorted(self._store.listing(self.path)):
            yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        for name in sorted(self._store.listing(self.path)):
            if fnmatch.fnmatchcase(name, pattern):
                yield self / name

    def _walk(self) -> Iterator[tuple[RemotePath, list[str], list[str]]]:
        listed = self._store.listing(self.path)
        dirs = sorted(n for n, e in listed.items() if e.get("type") == "directory")
        files = sorted(n for n, e in listed.items() if e.get("type") != "directory")
        yield self, dirs, files
        for name in dirs:
            yield from (self / name)._walk()

    def read_bytes(self) -> bytes:
        handle = self._store.handle(self.path)
        return handle.span(0, handle.known_size())  # a small file (``latest``) read twice is fetched once

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)
