"""One fsspec filesystem per storage, and what was seen of its files (infos, listings, kept bytes)."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any
from urllib.parse import unquote

from ..errors import RemoteError
from . import settings
from .handle import Handle
from .kept import Kept
from .problems import classify
from .remote_path import RemotePath

_lock = threading.Lock()
_stores: dict[int, _Store] = {}  # id(fsspec filesystem) -> what was seen through it
_made: dict[Any, tuple] = {}  # fsspec filesystem class -> the backends' environment when one was last made
_ENVIRONMENT = ("AWS_", "BOTO", "GOOGLE_", "GCS", "HF_", "HUGGING_FACE", "FSSPEC_")


def _environment() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENVIRONMENT)))


def _drop_stale_filesystems() -> None:
    """fsspec keeps one filesystem per class and options, with the credentials and endpoint it read from
    the environment when it was made: when that environment changed (a long-running process), they go."""
    now = _environment()
    for cls, then in list(_made.items()):
        if then != now:
            cls.clear_instance_cache()
            del _made[cls]


def store_for(url: str) -> _Store:
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
    _drop_stale_filesystems()
    try:
        fs, _ = url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        package, extra = settings.BACKENDS.get(protocol, (None, None))
        if isinstance(exc, ImportError) and package is not None:
            hint = f"pip install 'ckptspec[{extra}]' (it installs {package})"
        elif protocol not in fsspec.available_protocols():
            hint = f"fsspec knows no protocol {protocol!r}; it knows {', '.join(sorted(fsspec.available_protocols()))}"
        else:
            hint = "install the package fsspec names for this protocol"
        raise RemoteError("CK917", f"cannot read {protocol}:// URLs: {str(exc)[:200]}", hint, url) from None
    if protocol in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option): one attempt, see _options
    _made.setdefault(type(fs), _environment())
    with _lock:
        store = _stores.get(id(fs))
        if store is None or store.fs is not fs:
            store = _stores[id(fs)] = _Store(fs, protocol)
    return store


def _options(protocol: str) -> dict:
    """Storage options ckptspec sets: timeouts only (credentials stay in the backend's environment)."""
    seconds = settings.timeout()
    if protocol in ("http", "https"):
        try:
            import aiohttp
        except ImportError:
            return {}
        # total: a deadline for each request, which a server trickling a byte a second cannot keep alive
        limits = aiohttp.ClientTimeout(total=seconds, sock_connect=seconds, sock_read=seconds)
        return {"client_kwargs": {"timeout": limits}}
    if protocol in ("s3", "s3a"):
        # One attempt in botocore (and in s3fs, store_for): ckptspec's retries (CKPTSPEC_REMOTE_RETRIES) are
        # the only ones; else each of them is s3fs's 5 attempts of botocore's 5 (a closed port answers late).
        config = {"connect_timeout": seconds, "read_timeout": seconds, "retries": {"total_max_attempts": 1}}
        return {"config_kwargs": config}
    return {}


class _Store:
    """One fsspec filesystem: what was seen of its files (infos, listings, open handles, kept bytes)."""

    def __init__(self, fs, protocol: str):
        self.fs = fs
        self.protocol = protocol
        self.http = protocol in ("http", "https")
        self._infos: dict[str, dict | None] = {}
        self._listings: dict[str, dict[str, dict]] = {}
        self._handles: dict[str, Handle] = {}
        self.kept = Kept(settings.KEPT_BYTES)  # bytes fetched by small reads, not fetched again
        self.hashed: dict[tuple[str, str], str] = {}  # (path, algorithm) -> hex hash of the version read
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
        for attempt in range(settings.retries() + 1):
            try:
                result = fn(*args, **kwargs)
            except RemoteError:
                raise
            except Exception as exc:
                error, transient = classify(exc, url)
                if not transient or attempt >= settings.retries():
                    raise error from None
                time.sleep(settings.backoff(attempt))
                continue
            settings.count(0)
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

    def handle(self, path: str) -> Handle:
        with self._lock:
            found = self._handles.get(path)
        if found is None:
            found = Handle(self, path)
            with self._lock:
                found = self._handles.setdefault(path, found)
        return found


def forget() -> None:
    """Drop what was seen of remote files (sizes, ETags, listings) and reset ``fetched()``."""
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
    settings.reset()
    for store in stores:
        invalidate = getattr(store.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()
