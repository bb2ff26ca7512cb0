"""Where a checkpoint or manifest is: a local path, or a URL read through fsspec, reading only the bytes asked for.

``location(name)`` is the one place a name given by a user becomes something to read: a local
name (or a ``file://`` URL) is a ``pathlib.Path``, and every reader keeps today's code path for it;
any other URL (``s3://``, ``gs://``, ``hf://``, ``http(s)://``, whatever fsspec's registry offers) is
a ``RemotePath``, which answers the part of ``Path``'s API the readers use (``/``, ``name``,
``parent``, ``is_dir``, ``is_file``, ``iterdir``, ``stat().st_size``, ``read_text``,
``relative_to``) from the backend's listings and metadata, each asked once.

Bytes are read only in ranges: ``open_binary`` gives a seekable file whose reads fetch what they
ask for (a small read-ahead, and the last 64 KiB of a file together, where a zip keeps its
directory), so reading a torch file's zip directory and ``data.pkl`` fetches a few KiB of it.
``RangeStream`` fetches a list of byte ranges in order with a few requests in flight and
bounded memory, for reconstruction and hashing. Bytes fetched by small reads are kept, up to a
budget (``Kept``), and no later read of the command fetches them again; a reader that also checks
whole-file hashes reads each file once, front to back (``HashingStream``, ``FileHashes``).

Every request is retried with backoff on transient errors (a dropped connection, a timeout, a
5xx) and pinned to the version of the file first seen: HTTP requests carry ``If-Match`` with its
ETag (s3fs does the same for S3) and every answer must hold the bytes asked for, so a file that
changed while it was read is refused (CK913), never mixed. A problem is a ``RemoteError`` with a
code: not found (CK910), access denied (CK911), no range requests (CK912), changed (CK913), timeout
(CK914), connection (CK915); writing to an HTTP URL, and by the commands that do not upload (``embed``
without ``--sidecar-only``, ``scan --fix-latest``, ``--keep``), is refused (CK916); a URL whose backend is not
installed or not known is CK917. ``reconstruct``, ``reshard``, ``export``, ``export-universal``,
``embed --sidecar-only`` and the manifest writers (``generate -o``, ``convert``, ``migrate``, ``extract -o``)
write to object stores (``upload``: built locally, uploaded object by object, the object readers look for last,
each verified; CK920 when one differs).

What a process has seen of a remote file (size, ETag, listings) is kept until ``forget()``
(each ``ckptspec`` command starts with it), so that a file read by validation and again by
reconstruction is the same file. Credentials come from each backend's own environment (AWS_*
variables and files for s3fs, GOOGLE_APPLICATION_CREDENTIALS for gcsfs, HF_TOKEN for the hub, the
URL or ~/.netrc for HTTP). fsspec and its backends are imported only when a URL is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias, cast
from urllib.parse import unquote

from ..errors import FileUnreadable, RemoteError
from .handle import RangedFile
from .hashed import FileHashes, HashingStream, known_hash, merged_spans, remember_hash
from .problems import not_found
from .remote_path import RemotePath
from .settings import CHUNK, Fetched, fetched
from .store import forget, store_for
from .stream import RangeStream, fetch_range, iter_chunks

# What a reader takes: a local path, or a URL (a str, or a ``RemotePath``) read through fsspec.
AnyPath: TypeAlias = str | os.PathLike | RemotePath

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(?:::[A-Za-z][A-Za-z0-9+.\-]*)*://")

# --------------------------------------------------------------------------- names


def is_url(name: Any) -> bool:
    """A URL that fsspec reads (``file://`` included), as opposed to a local path."""
    return isinstance(name, str) and bool(_URL.match(name))


def is_remote(name: Any) -> bool:
    """A remote location: a ``RemotePath``, or a URL that is not ``file://``."""
    if isinstance(name, RemotePath):
        return True
    return is_url(name) and not name.lower().startswith("file://")


def location(name: AnyPath) -> Path | RemotePath:
    """What ``name`` names: a ``Path`` for a local name or ``file://`` URL, a ``RemotePath`` for any other URL."""
    if isinstance(name, (Path, RemotePath)):
        return name
    text = os.fspath(name)
    if not is_url(text):
        return Path(text)
    if text.lower().startswith("file://"):
        return Path(unquote(text[len("file://") :]))
    return store_for(text).root(text)


def is_directory(name: str | os.PathLike) -> bool:
    """``os.path.isdir`` for local names; for a URL, whether it names a directory (a prefix, an index page)."""
    where = location(name)
    return where.is_dir() if isinstance(where, RemotePath) else os.path.isdir(where)


def exists(name: str | os.PathLike) -> bool:
    where = location(name)
    return where.exists() if isinstance(where, RemotePath) else os.path.exists(where)


def writable(name: str | os.PathLike, what: str = "the output") -> None:
    """Before a command reads anything: an output at a URL needs its backend (CK917) and a store that takes
    writes: HTTP is read-only (CK916); a local one, nothing."""
    if is_remote(name):
        if os.fspath(name).lower().startswith(("http://", "https://")):
            refuse_write(name, what)
        store_for(os.fspath(name))


def refuse_write(name: str | os.PathLike, what: str) -> None:
    """Raise CK916 when ``name`` is remote: for a writer that does not upload (``upload`` is the one that does)."""
    if is_remote(name):
        raise RemoteError(
            "CK916",
            f"{what} cannot be written to this URL: read-only for ckptspec",
            "write to a local path, or to an object store's URL (s3://, gs://...) where the command writes one "
            "(reconstruct, reshard, export, export-universal, embed --sidecar-only, generate -o, convert, migrate, "
            "extract -o)",
            str(name),
        )


def open_binary(path: AnyPath) -> BinaryIO:
    """A seekable binary file: ``open(path, "rb")`` for a local path, ranged reads for a remote one."""
    where = location(path)
    if isinstance(where, RemotePath):
        # A RawIOBase: BinaryIO's read/seek/tell/close, which is all a reader of the file uses.
        return cast(BinaryIO, RangedFile(where._store.handle(where.path)))
    return open(where, "rb")


def read_range(path: Path | RemotePath, offset: int, size: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (fewer at the end of the file, as ``os.pread``): one ``pread`` of a
    local file; of a remote one, what an earlier read kept, the rest fetched and kept (``Kept``), so that
    a later read of the command (a hash, a tensor) does not fetch it again."""
    if isinstance(path, RemotePath):
        handle = path._store.handle(path.path)
        end = min(offset + size, handle.known_size())
        return handle.span(offset, end) if end > offset else b""
    with open(path, "rb") as fh:
        return os.pread(fh.fileno(), size, offset)


def walk(directory: Path | RemotePath) -> Iterator[tuple[Path | RemotePath, list[str], list[str]]]:
    """``os.walk`` (top down, names sorted) that yields the directory itself instead of its name.
    A folder this user may not list is CK901 (``os.walk`` would leave it out without a word)."""
    if isinstance(directory, RemotePath):
        yield from directory._walk()
        return
    for root, dirs, files in os.walk(directory, onerror=_unlistable):
        dirs.sort()
        yield Path(root), dirs, sorted(files)


def _unlistable(exc: OSError) -> None:
    raise FileUnreadable(exc.filename, exc)


def relative_name(file: str, root: Path | RemotePath) -> str | None:
    """``file`` (a name a reader gave) relative to ``root`` as a posix path, or None when it is not below it."""
    if isinstance(root, RemotePath):
        prefix = str(root).rstrip("/") + "/"
        return file[len(prefix) :] if file.startswith(prefix) else None
    path = Path(file)
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else None


__all__ = [
    "AnyPath",
    "CHUNK",
    "FileHashes",
    "Fetched",
    "HashingStream",
    "RangeStream",
    "RemoteError",
    "RemotePath",
    "exists",
    "fetch_range",
    "fetched",
    "forget",
    "is_directory",
    "is_remote",
    "is_url",
    "iter_chunks",
    "known_hash",
    "location",
    "merged_spans",
    "not_found",
    "open_binary",
    "read_range",
    "refuse_write",
    "relative_name",
    "remember_hash",
    "walk",
    "writable",
]
