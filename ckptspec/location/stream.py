"""Bulk reads: several byte ranges fetched in order, a few requests in flight, bounded memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from . import settings
from .kept import parts
from .remote_path import RemotePath


class RangeStream:
    """The bytes of several byte ranges, in order, with a few range requests in flight.

    ``ranges``: ``(path, start, end)`` in the order they will be read; ranges that follow each other
    in one file are joined (the tensors of a flat partition: one request, not one per tensor). Bytes
    a small read fetched before (``Kept``) are taken from memory; the rest is fetched in pieces of at
    most ``CHUNK`` bytes, at most ``IN_FLIGHT`` ahead of the reader, so memory stays near
    ``IN_FLIGHT * CHUNK`` whatever the sizes. ``next()`` gives ``(path, start, bytes)`` or None at the end.
    """

    def __init__(
        self, ranges: Iterable[tuple[RemotePath, int, int]], chunk: int | None = None, depth: int | None = None
    ):
        chunk, depth = chunk or settings.CHUNK, depth or settings.IN_FLIGHT
        self._pieces = self._split(ranges, chunk)
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ckptspec-fetch")
        self._queue: deque[tuple[RemotePath, int, Future]] = deque()
        self._depth = depth
        self._fill()

    @staticmethod
    def _split(ranges, chunk) -> Iterator[tuple[RemotePath, int, int, memoryview | None]]:
        """Pieces of at most ``chunk`` bytes to fetch, and the parts already kept (``Kept``), with their bytes."""
        for path, start, end in runs(ranges):
            kept = path._store.kept.overlapping(path.path, start, end)
            for a, b, data in parts(kept, start, end):
                if data is not None:
                    yield path, a, b, data
                    continue
                for at in range(a, b, chunk):
                    yield path, at, min(b, at + chunk), None

    def _fill(self) -> None:
        while len(self._queue) < self._depth:
            piece = next(self._pieces, None)
            if piece is None:
                return
            path, start, end, data = piece
            future: Future[bytes | memoryview]
            if data is None:
                handle = path._store.handle(path.path)
                future = self._pool.submit(handle.fetch, start, end)
            else:
                future = Future()
                future.set_result(data)
            self._queue.append((path, start, future))

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


def runs(ranges: Iterable[tuple[RemotePath, int, int]]) -> Iterator[tuple[RemotePath, int, int]]:
    """Consecutive ranges joined where one starts in the same file where the previous ends."""
    run = None
    for path, start, end in ranges:
        if end <= start:
            continue
        if run is not None and run[0] == path and run[2] == start:
            run = (path, run[1], end)
            continue
        if run is not None:
            yield run
        run = (path, start, end)
    if run is not None:
        yield run


def fetch_range(path: RemotePath, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a remote file, in one request (retried)."""
    return path._store.handle(path.path).fetch(start, end)


def iter_chunks(path: RemotePath) -> Iterator[bytes]:
    """Every byte of a remote file, in order, fetched ahead (for hashing)."""
    size = path.stat().st_size
    with RangeStream([(path, 0, size)]) as stream:
        while (piece := stream.next()) is not None:
            yield piece[2]
