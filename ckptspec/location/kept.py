"""Bytes of remote files already fetched for small reads, kept so that no later read fetches them again.

A command reads a torch file's zip directory (its last 64 KiB), then ``data.pkl`` and the local
headers, then maybe every byte (to hash it) or its tensors (to write them): the later reads take
the kept bytes instead of asking for them again. Memory stays bounded: at most ``budget`` bytes
are kept, the least recently used dropped first (a dropped span is fetched again when needed:
more bytes, never a wrong one, as every file is pinned to the version first seen).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict


class Kept:
    """Spans ``[start, start + len(data))`` of remote files, by path, within a byte budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self._by_path: dict[str, list[tuple[int, bytes]]] = {}  # sorted by start
        self._order: OrderedDict[tuple[str, int], int] = OrderedDict()  # (path, start) -> size, oldest first
        self._size = 0
        self._lock = threading.Lock()

    def keep(self, path: str, start: int, data: bytes) -> None:
        if not data or len(data) > self.budget:
            return
        with self._lock:
            spans = self._by_path.setdefault(path, [])
            end = start + len(data)
            i = bisect.bisect_left(spans, start, key=lambda s: s[0])
            # No span lies inside another (so their ends rise with their starts, and ``overlapping``
            # finds every span of a range from the last one starting before it): a span already
            # covered is not kept again, and one the new span covers gives way to it.
            for j in (i - 1, i):
                if 0 <= j < len(spans) and spans[j][0] <= start and spans[j][0] + len(spans[j][1]) >= end:
                    return
            while i < len(spans) and spans[i][0] + len(spans[i][1]) <= end:
                self._drop(path, i)
            spans = self._by_path.setdefault(path, spans)  # _drop forgets a path whose last span it drops
            bisect.insort(spans, (start, data), key=lambda s: s[0])
            self._order[(path, start)] = len(data)
            self._size += len(data)
            while self._size > self.budget:
                (old_path, old_start), _ = self._order.popitem(last=False)
                old = self._by_path[old_path]
                self._drop(old_path, bisect.bisect_left(old, old_start, key=lambda s: s[0]), ordered=False)

    def _drop(self, path: str, i: int, ordered: bool = True) -> None:
        spans = self._by_path[path]
        start, data = spans.pop(i)
        self._size -= len(data)
        if ordered:
            del self._order[(path, start)]
        if not spans:
            del self._by_path[path]

    def overlapping(self, path: str, start: int, end: int) -> list[tuple[int, bytes]]:
        """The kept spans of ``path`` that share a byte with ``[start, end)``, by start (each marked used)."""
        with self._lock:
            spans = self._by_path.get(path, [])
            i = max(0, bisect.bisect_right(spans, start, key=lambda s: s[0]) - 1)
            found = []
            for span_start, data in spans[i:]:
                if span_start >= end:
                    break
                if span_start + len(data) > start:
                    found.append((span_start, data))
                    self._order.move_to_end((path, span_start))
            return found


def parts(kept: list[tuple[int, bytes]], start: int, end: int) -> list[tuple[int, int, memoryview | None]]:
    """``[start, end)`` cut into ``(start, end, kept bytes)`` pieces and ``(start, end, None)`` gaps to fetch."""
    out: list[tuple[int, int, memoryview | None]] = []
    at = start
    for span_start, data in kept:
        span_end = span_start + len(data)
        if span_end <= at or span_start >= end:
            continue
        if span_start > at:
            out.append((at, span_start, None))
            at = span_start
        stop = min(end, span_end)
        out.append((at, stop, memoryview(data)[at - span_start : stop - span_start]))
        at = stop
    if at < end:
        out.append((at, end, None))
    return out
