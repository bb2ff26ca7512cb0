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
bounded memory, for reconstruction and hashing.

Every request is retried with backoff on transient errors (a dropped connection, a timeout, a
5xx) and pinned to the version of the file first seen: HTTP requests carry ``If-Match`` with its
ETag (s3fs does the same for S3) and every answer must hold the bytes asked for, so a file that
changed while it was read is refused (CK913), never mixed. A problem is a ``RemoteError`` with a
code: not found (CK910), access denied (CK911), no range requests (CK912), changed (CK913), timeout
(CK914), connection (CK915); writing to a URL is refused (CK916); a URL whose backend is not
installed or not known is CK917.

What a process has seen of a remote file (size, ETag, listings) is kept until ``forget()``
(each ``ckptspec`` command starts with it), so that a file read by validation and again by
reconstruction is the same file. Credentials come from each backend's own environment (AWS_*
variables and files for s3fs, GOOGLE_APPLICATION_CREDENTIALS for gcsfs, HF_TOKEN for the hub, the
URL or ~/.netrc for HTTP). fsspec and its backends are imported only when a URL is read.
"""

from __future__ import annotations

import errno
import fnmatch
import io
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import unquote

from .errors import RemoteError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(?:::[A-Za-z][A-Za-z0-9+.\-]*)*://")


def _setting(name: str, default: int, least: int) -> int:
    """An integer setting from the environment (``CKPTSPEC_REMOTE_*``); a bad value keeps the default."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return default
    return max(value, least)


READ_AHEAD = 16 * 1024  # a read of metadata fetches at least this much (zip local headers, data.pkl)
TAIL = 64 * 1024  # the last bytes of a file, fetched at once: a zip's end record and central directory
CHUNK = _setting("CKPTSPEC_REMOTE_CHUNK", 1024 * 1024, 64 * 1024)  # bytes per range request of a bulk read
IN_FLIGHT = _setting("CKPTSPEC_REMOTE_IN_FLIGHT", 4, 1)  # requests in flight: memory ~ 2 * IN_FLIGHT * CHUNK
RETRIES = _setting("CKPTSPEC_REMOTE_RETRIES", 3, 0)  # retries after a transient error (then the error stands)
BACKOFF = 0.25  # seconds before the first retry; doubled for each next one
_TAILS_KEPT = 8  # recent files' tails kept, so that a zip directory read twice is fetched once

BACKENDS = {  # protocol -> the package that provides it, and the ckptspec extra that installs it
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "http"),
}


def timeout() -> float:
    """Seconds to wait for a connection or for the next bytes of an answer (``CKPTSPEC_REMOTE_TIMEOUT``)."""
    try:
        value = float(os.environ.get("CKPTSPEC_REMOTE_TIMEOUT", "60"))
    except ValueError:
        value = 60.0
    return value if value > 0 else 60.0


# --------------------------------------------------------------------------- names


def is_url(name: Any) -> bool:
    """A URL that fsspec reads (``file://`` included), as opposed to a local path."""
    return isinstance(name, str) and bool(_URL.match(name))


def is_remote(name: Any) -> bool:
    """A remote location: a ``RemotePath``, or a URL that is not ``file://``."""
    if isinstance(name, RemotePath):
        return True
    return is_url(name) and not name.lower().startswith("file://")


def location(name: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """What ``name`` names: a ``Path`` for a local name or ``file://`` URL, a ``RemotePath`` for any other URL."""
    if isinstance(name, (Path, RemotePath)):
        return name
    text = os.fspath(name)
    if not is_url(text):
        return Path(text)
    if text.lower().startswith("file://"):
        return Path(unquote(text[len("file://") :]))
    return _store_for(text).root(text)


def is_directory(name: str | os.PathLike) -> bool:
    """``os.path.isdir`` for local names; for a URL, whether it names a directory (a prefix, an index page)."""
    where = location(name)
    return where.is_dir() if isinstance(where, RemotePath) else os.path.isdir(where)


def exists(name: str | os.PathLike) -> bool:
    where = location(name)
    return where.exists() if isinstance(where, RemotePath) else os.path.exists(where)


def refuse_write(name: str | os.PathLike, what: str) -> None:
    """Raise CK916 when ``name`` is remote: ckptspec writes only local files."""
    if is_remote(name):
        raise RemoteError(
            "CK916",
            f"{what} cannot be written to a URL: remote locations are read-only for ckptspec",
            "write to a local path (and copy the result with your storage's own tool, e.g. `aws s3 cp`)",
            str(name),
        )


def open_binary(path: str | os.PathLike | RemotePath) -> BinaryIO:
    """A seekable binary file: ``open(path, "rb")`` for a local path, ranged reads for a remote one."""
    where = location(path)
    if isinstance(where, RemotePath):
        return _RangedFile(where._store.handle(where.path))
    return open(where, "rb")


def walk(directory: Path | RemotePath) -> Iterator[tuple[Path | RemotePath, list[str], list[str]]]:
    """``os.walk`` (top down, names sorted) that yields the directory itself instead of its name."""
    if isinstance(directory, RemotePath):
        yield from directory._walk()
        return
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        yield Path(root), dirs, sorted(files)


def relative_name(file: str, root: Path | RemotePath) -> str | None:
    """``file`` (a name a reader gave) relative to ``root`` as a posix path, or None when it is not below it."""
    if isinstance(root, RemotePath):
        prefix = str(root).rstrip("/") + "/"
        return file[len(prefix) :] if file.startswith(prefix) else None
    path = Path(file)
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else None


def iter_chunks(path: Path | RemotePath) -> Iterator[bytes]:
    """Every byte of a remote file, in order, fetched ahead (for hashing)."""
    size = path.stat().st_size
    with RangeStream([(path, 0, size)]) as stream:
        while (piece := stream.next()) is not None:
            yield piece[2]


# --------------------------------------------------------------------------- what was fetched


@dataclass(frozen=True)
class Fetched:
    """Bytes of file content fetched from remote locations, and the requests made, since ``forget()``."""

    bytes: int = 0
    requests: int = 0


_lock = threading.Lock()
_counts = {"bytes": 0, "requests": 0}
_stores: dict[int, _Store] = {}


def fetched() -> Fetched:
    with _lock:
        return Fetched(_counts["bytes"], _counts["requests"])


def _count(nbytes: int, requests: int = 1) -> None:
    with _lock:
        _counts["bytes"] += nbytes
        _counts["requests"] += requests


def forget() -> None:
    """Drop what was seen of remote files (sizes, ETags, listings) and reset ``fetched()``."""
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
        _counts.update(bytes=0, requests=0)
    for store in stores:
        invalidate = getattr(store.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()


# --------------------------------------------------------------------------- errors


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


# Exception classes by name (aiohttp, botocore, urllib3 are imported only by the backends).
_TIMEOUTS = {"TimeoutError", "ServerTimeoutError", "FSTimeoutError", "ReadTimeoutError", "ConnectTimeoutError"}
_CONNECTION = {
    "ConnectionError",
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientOSError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "IncompleteRead",
    "ProtocolError",
    "HTTPClientError",
}
_HINT_RETRY = "the storage or the network failed; try again (CKPTSPEC_REMOTE_TIMEOUT sets the timeout in seconds)"


def classify(exc: BaseException, url: str) -> tuple[RemoteError, bool]:
    """The ``RemoteError`` for a backend's exception, and whether trying again may help."""
    chain = _chain(exc)
    for e in chain:
        status = getattr(e, "status", None)
        if not isinstance(status, int):
            status = _boto_status(e)
        if status is not None and status >= 400:
            return _for_status(status, url, str(e)), status >= 500 or status in (408, 429)
    for e in chain:
        names = _names(e)
        if "FileExpired" in names or (isinstance(e, OSError) and "pre-condition" in str(e)):
            return changed(url, "its ETag changed while it was read"), False
        if isinstance(e, ValueError) and "range requests" in str(e):
            return no_ranges(url), False
        if names & _TIMEOUTS:
            return RemoteError("CK914", "timed out", _HINT_RETRY, url), True
    for e in chain:
        if _names(e) & _CONNECTION or isinstance(e, ConnectionError):
            detail = str(e).strip() or type(e).__name__
            return RemoteError("CK915", f"connection failed: {detail[:200]}", _HINT_RETRY, url), True
    for e in chain:
        if isinstance(e, PermissionError):
            return denied(url, str(e)), False
        if isinstance(e, FileNotFoundError):
            return not_found(url), False
        if isinstance(e, OSError) and e.errno in (errno.ETIMEDOUT,):
            return RemoteError("CK914", "timed out", _HINT_RETRY, url), True
    detail = f"{type(exc).__name__}: {exc}"[:300]
    return RemoteError("CK901", f"cannot read: {detail}", "check the URL and the storage's credentials", url), False


def _boto_status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def _for_status(status: int, url: str, detail: str) -> RemoteError:
    if status == 404:
        return not_found(url)
    if status in (401, 403):
        return denied(url, f"HTTP {status}")
    if status == 412:
        return changed(url, "its ETag changed while it was read")
    if status == 416:
        return changed(url, "the server has fewer bytes than it said")
    if status in (408, 504):
        return RemoteError("CK914", f"timed out (HTTP {status})", _HINT_RETRY, url)
    return RemoteError("CK915", f"the server answered HTTP {status}", _HINT_RETRY, url)


def not_found(url: str, what: str = "not found") -> RemoteError:
    return RemoteError("CK910", what, "check the URL: bucket, path and tag", url)


def denied(url: str, detail: str = "") -> RemoteError:
    return RemoteError(
        "CK911",
        "access denied" + (f" ({detail})" if detail else ""),
        "check the credentials in the backend's environment (AWS_* for s3://, GOOGLE_APPLICATION_CREDENTIALS for "
        "gs://, HF_TOKEN for hf://); over HTTP the server must allow reading and listing this directory",
        url,
    )


def changed(url: str, what: str) -> RemoteError:
    return RemoteError(
        "CK913",
        f"the file changed while it was read: {what}",
        "something is writing this checkpoint; read it again once the save is complete",
        url,
    )


def no_ranges(url: str) -> RemoteError:
    return RemoteError(
        "CK912",
        "the server does not answer range requests",
        "ckptspec reads only the parts of each file it needs; serve the files from a server that supports "
        "HTTP range requests (nginx, S3, GCS do), or download the checkpoint first",
        url,
    )


# --------------------------------------------------------------------------- backends


def _store_for(url: str) -> _Store:
    protocol = url.split("://", 1)[0].split("::")[-1].lower()
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise RemoteError(
            "CK917",
            "reading URLs needs fsspec",
            "pip install 'ckptspec[remote]' (or the extra of your storage: http, s3, gcs, hf)",
            url,
        ) from None
    options = _options(protocol)
    try:
        fs, _ = url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        package, extra = BACKENDS.get(protocol, (None, None))
        if isinstance(exc, ImportError) and package is not None:
            hint = f"pip install 'ckptspec[{extra}]' (it installs {package})"
        elif protocol not in fsspec.available_protocols():
            hint = f"fsspec knows no protocol {protocol!r}; it knows {', '.join(sorted(fsspec.available_protocols()))}"
        else:
            hint = "install the package fsspec names for this protocol"
        raise RemoteError("CK917", f"cannot read {protocol}:// URLs: {str(exc)[:200]}", hint, url) from None
    with _lock:
        store = _stores.get(id(fs))
        if store is None or store.fs is not fs:
            store = _stores[id(fs)] = _Store(fs, protocol)
    return store


def _options(protocol: str) -> dict:
    """Storage options ckptspec sets: timeouts only (credentials stay in the backend's environment)."""
    seconds = timeout()
    if protocol in ("http", "https"):
        try:
            import aiohttp
        except ImportError:
            return {}
        limits = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
        return {"client_kwargs": {"timeout": limits}}
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": seconds, "read_timeout": seconds}}
    return {}


class _Store:
    """One fsspec filesystem: what was seen of its files (infos, listings, open handles)."""

    def __init__(self, fs, protocol: str):
        self.fs = fs
        self.protocol = protocol
        self.http = protocol in ("http", "https")
        self._infos: dict[str, dict | None] = {}
        self._listings: dict[str, dict[str, dict]] = {}
        self._handles: dict[str, _Handle] = {}
        self.tails: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, url: str) -> str:
        """The path the filesystem uses for ``url`` (no trailing slash)."""
        path = url if self.http else self.fs._strip_protocol(url)
        stripped = path.rstrip("/")
        return stripped if stripped and len(stripped) >= len(self.root_of(path)) else path

    def root_of(self, path: str) -> str:
        if self.http:
            m = re.match(r"^[A-Za-z]+://[^/]*/?", path)
            return m.group(0).rstrip("/") if m else path
        return ""

    def url(self, path: str) -> str:
        return path if self.http else self.fs.unstrip_protocol(path)

    def root(self, url: str) -> RemotePath:
        path = self.key(url)
        if self.http and url.endswith("/") and path not in self._infos:
            self._infos[path] = {"name": path, "type": "directory", "size": None}  # HTTP's convention: no request
        return RemotePath(self, path)

    def known_dir(self, path: str) -> bool:
        """``path`` is known to be a directory (from its info or its parent's listing), without a request."""
        info = self._infos.get(path)
        if info is not None:
            return info.get("type") == "directory"
        parent, _, name = path.rpartition("/")
        listed = self._listings.get(parent)
        return listed is not None and (listed.get(name) or {}).get("type") == "directory"

    def call(self, url: str, fn, *args, **kwargs):
        """A metadata call (info, listing), retried like a range request; errors become ``RemoteError``."""
        for attempt in range(RETRIES + 1):
            try:
                result = fn(*args, **kwargs)
            except RemoteError:
                raise
            except Exception as exc:
                error, transient = classify(exc, url)
                if not transient or attempt >= RETRIES:
                    raise error from None
                time.sleep(BACKOFF * 2**attempt)
                continue
            _count(0)
            return result
        raise AssertionError("unreachable")

    def info(self, path: str) -> dict | None:
        """The file's or directory's info (``type``, ``size``, ETag), None when it does not exist."""
        if path in self._infos:
            return self._infos[path]
        parent, _, name = path.rpartition("/")
        listed = self._listings.get(parent)
        if listed is not None and name in listed and listed[name].get("size") is not None:
            return listed[name]
        try:
            info = self.call(self.url(path), self.fs.info, path)
        except RemoteError as exc:
            if exc.code != "CK910":
                raise
            info = None
        if info is not None and self.http:
            # An HTTP server answers a directory's URL with its index page.
            final = str(info.get("url", path))
            directory = info.get("mimetype") == "text/html" or final.endswith("/")
            info = {**info, "type": "directory" if directory else "file"}
        self._infos[path] = info
        return info

    def listing(self, path: str) -> dict[str, dict]:
        """name -> info of the entries of a directory, listed once."""
        listed = self._listings.get(path)
        if listed is not None:
            return listed
        url = self.url(path)
        entries = self.call(url, self.fs.ls, path + "/" if self.http else path, detail=True)
        listed = {}
        for entry in entries:
            if isinstance(entry, str):  # fsspec's HTTP listing of an empty page falls back to plain names
                entry = {"name": entry, "type": "directory" if entry.endswith("/") else "file", "size": None}
            full = str(entry.get("name", "")).rstrip("/")
            name = full.rsplit("/", 1)[-1]
            if self.http:
                name = unquote(name)
            if not name or full == path:
                continue
            listed[name] = {**entry, "type": entry.get("type", "file")}
        self._listings[path] = listed
        return listed

    def handle(self, path: str) -> _Handle:
        with self._lock:
            found = self._handles.get(path)
        if found is None:
            found = _Handle(self, path)
            with self._lock:
                found = self._handles.setdefault(path, found)
        return found

    def tail(self, path: str) -> bytes | None:
        with self._lock:
            return self.tails.get(path)

    def keep_tail(self, path: str, data: bytes) -> None:
        with self._lock:
            self.tails[path] = data
            self.tails.move_to_end(path)
            while len(self.tails) > _TAILS_KEPT:
                self.tails.popitem(last=False)


class _Handle:
    """One remote file as first seen (size, ETag): ranged reads of that version only."""

    def __init__(self, store: _Store, path: str):
        self.store, self.path, self.url = store, path, store.url(path)
        info = store.info(path)
        if info is None:
            raise not_found(self.url)
        if info.get("type") == "directory":
            raise RemoteError("CK901", "is a directory, not a file", "pass the file's URL", self.url)
        if store.http and info.get("partial") is False:
            raise no_ranges(self.url)
        self.size = int(info["size"]) if info.get("size") is not None else None
        self.etag = info.get("ETag") or info.get("etag")
        self.modified = info.get("Last-Modified")  # pins an HTTP file when its server sends no ETag
        self._file = None
        self._open_lock = threading.Lock()
        self._block: tuple[int, bytes] | None = None  # the last read-ahead block (metadata reads)

    def _opened(self):
        with self._open_lock:
            if self._file is None:
                kwargs: dict[str, Any] = {"cache_type": "none"}
                if self.store.http:
                    kwargs.update(block_size=CHUNK, size=self.size)
                    if self.etag:
                        kwargs["headers"] = {"If-Match": self.etag}
                    elif self.modified:
                        kwargs["headers"] = {"If-Unmodified-Since": self.modified}
                opened = self.store.call(self.url, self.store.fs.open, self.path, "rb", **kwargs)
                # The backend looked at the file again to open it (s3fs pins that version with If-Match):
                # it must be the one whose size and ETag were seen first.
                details = getattr(opened, "details", None) or {}
                etag, size = details.get("ETag"), getattr(opened, "size", None)
                other_size = self.size is not None and size not in (None, self.size)
                if (self.etag and etag and etag != self.etag) or other_size:
                    raise changed(self.url, f"it was {self.size} bytes (ETag {self.etag}), now {size} (ETag {etag})")
                if self.size is None:
                    self.size = size
                self._file = opened
            return self._file

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of this version of the file, retried on transient errors."""
        if end <= start:
            return b""
        for attempt in range(RETRIES + 1):
            try:
                handle = self._opened()
                fetch = getattr(handle, "_fetch_range", None)
                data = fetch(start, end) if fetch is not None else self.store.fs.cat_file(self.path, start, end)
            except RemoteError:
                raise
            except Exception as exc:
                error, transient = classify(exc, self.url)
                if not transient or attempt >= RETRIES:
                    raise error from None
                time.sleep(BACKOFF * 2**attempt)
                continue
            _count(len(data))
            if len(data) != end - start:
                raise changed(self.url, f"asked for bytes {start}-{end - 1}, got {len(data)} bytes")
            return bytes(data)
        raise AssertionError("unreachable")

    def read_at(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` for a metadata read: the file's tail and a read-ahead block are kept."""
        size = self.size if self.size is not None else self._opened().size
        end = min(pos + n, size)
        if end <= pos:
            return b""
        tail_start = max(0, size - TAIL)
        if pos >= tail_start:
            tail = self.store.tail(self.path)
            if tail is None:
                tail = self.fetch(tail_start, size)
                self.store.keep_tail(self.path, tail)
            return tail[pos - tail_start : end - tail_start]
        block = self._block
        if block is not None and block[0] <= pos and end <= block[0] + len(block[1]):
            return block[1][pos - block[0] : end - block[0]]
        fetch_end = min(size, max(end, pos + READ_AHEAD))
        data = self.fetch(pos, fetch_end)
        self._block = (pos, data)
        return data[: end - pos]


class _RangedFile(io.RawIOBase):
    """A seekable, read-only file over a ``_Handle``."""

    def __init__(self, handle: _Handle):
        super().__init__()
        self._handle, self._pos = handle, 0
        if handle.size is None:
            handle._opened()
        self.name = handle.url

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._handle.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._handle.read_at(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


# --------------------------------------------------------------------------- paths


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
            return entry is not None and entry.get("type") == kind
        info = self._info()
        return info is not None and info.get("type") == kind

    def stat(self) -> _Stat:
        info = self._info()
        if info is None:
            raise not_found(str(self))
        if info.get("size") is None:
            info = self._store.handle(self.path)
            return _Stat(int(info.size if info.size is not None else 0))
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
        size = handle.size if handle.size is not None else handle._opened().size
        return handle.fetch(0, size)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


# --------------------------------------------------------------------------- bulk reads


class RangeStream:
    """The bytes of several byte ranges, in order, with a few range requests in flight.

    ``ranges``: ``(path, start, end)`` in the order they will be read; each is fetched in pieces of
    at most ``CHUNK`` bytes, at most ``IN_FLIGHT`` ahead of the reader, so memory stays near
    ``IN_FLIGHT * CHUNK`` whatever the sizes. ``next()`` gives ``(path, start, bytes)`` or None at the end.
    """

    def __init__(
        self, ranges: Iterable[tuple[RemotePath, int, int]], chunk: int | None = None, depth: int | None = None
    ):
        chunk, depth = chunk or CHUNK, depth or IN_FLIGHT
        self._pieces = self._split(ranges, chunk)
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ckptspec-fetch")
        self._queue: deque[tuple[RemotePath, int, Future]] = deque()
        self._depth = depth
        self._fill()

    @staticmethod
    def _split(ranges, chunk) -> Iterator[tuple[RemotePath, int, int]]:
        for path, start, end in ranges:
            for at in range(start, end, chunk):
                yield path, at, min(end, at + chunk)

    def _fill(self) -> None:
        while len(self._queue) < self._depth:
            piece = next(self._pieces, None)
            if piece is None:
                return
            path, start, end = piece
            handle = path._store.handle(path.path)
            self._queue.append((path, start, self._pool.submit(handle.fetch, start, end)))

    def peek(self) -> tuple[RemotePath, int] | None:
        return (self._queue[0][0], self._queue[0][1]) if self._queue else None

    def next(self) -> tuple[RemotePath, int, bytes] | None:
        if not self._queue:
            return None
        path, start, future = self._queue.popleft()
        data = future.result()
        self._fill()
        return path, start, data

    def close(self) -> None:
        for _, _, future in self._queue:
            future.cancel()
        self._queue.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RangeStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch_range(path: RemotePath, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a remote file, in one request (retried)."""
    return path._store.handle(path.path).fetch(start, end)


__all__ = [
    "Fetched",
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
    "location",
    "not_found",
    "open_binary",
    "refuse_write",
    "relative_name",
    "walk",
]
