"""One remote file as first seen (size, ETag), read in ranges of that version only."""

from __future__ import annotations

import errno
import io
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import RemoteError
from . import settings
from .kept import parts
from .problems import changed, classify, no_ranges, not_found

if TYPE_CHECKING:
    from .store import _Store


class Handle:
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

    def _opened(self):
        with self._open_lock:
            if self._file is None:
                kwargs: dict[str, Any] = {"cache_type": "none"}
                if self.store.http:
                    kwargs.update(block_size=settings.CHUNK, size=self.size)
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
        for attempt in range(settings.retries() + 1):
            try:
                handle = self._opened()
                fetch = getattr(handle, "_fetch_range", None)
                data = fetch(start, end) if fetch is not None else self.store.fs.cat_file(self.path, start, end)
            except RemoteError:
                raise
            except Exception as exc:
                error, transient = classify(exc, self.url)
                if not transient or attempt >= settings.retries():
                    raise error from None
                time.sleep(settings.backoff(attempt))
                continue
            settings.count(len(data))
            if len(data) != end - start:
                raise changed(self.url, f"asked for bytes {start}-{end - 1}, got {len(data)} bytes")
            return bytes(data)
        raise AssertionError("unreachable")

    def known_size(self) -> int:
        return self.size if self.size is not None else self._opened().size

    def read_at(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` for a metadata read: a read in the file's last ``TAIL`` bytes
        (a zip's end record and central directory) fetches all of them, any other at least
        ``READ_AHEAD`` bytes; what is fetched is kept (``store.kept``), and a kept byte is not fetched again."""
        size = self.known_size()
        end = min(pos + n, size)
        if end <= pos:
            return b""
        tail_start = max(0, size - settings.TAIL)
        if pos >= tail_start:
            return self.span(tail_start, size, pos, end, every_gap=True)
        return self.span(pos, max(end, min(size, pos + settings.READ_AHEAD)), pos, end)

    def span(
        self, start: int, stop: int, pos: int | None = None, end: int | None = None, every_gap: bool = False
    ) -> bytes:
        """Bytes ``[pos, end)`` (default: all of ``[start, stop)``), fetching what is not kept of
        ``[start, stop)``: every missing part with ``every_gap``, else only the ones that hold a
        byte asked for (each up to the next kept byte: the read-ahead). What is fetched is kept."""
        pos, end = start if pos is None else pos, stop if end is None else end
        got = []
        for a, b, data in parts(self.store.kept.overlapping(self.path, start, stop), start, stop):
            if data is None:
                if not every_gap and (b <= pos or a >= end):
                    continue
                fetched = self.fetch(a, b)
                self.store.kept.keep(self.path, a, fetched)
                data = memoryview(fetched)
            if a < end and b > pos:
                got.append(data[max(pos, a) - a : min(end, b) - a])
        return b"".join(got)


class RangedFile(io.RawIOBase):
    """A seekable, read-only file over a ``Handle``."""

    def __init__(self, handle: Handle):
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
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: -1}[whence]
        if whence == io.SEEK_END:
            base = self._handle.known_size()  # known since __init__ (_opened): no request
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
