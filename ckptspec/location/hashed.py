"""Whole-file hashes of remote files, fed with bytes fetched anyway: each byte is fetched once.

A command that checks a file's recorded hash and also reads parts of it (``reconstruct`` reads
the fp32 masters) does both in one read of the file, front to back: the parts the reader wants,
the bytes between them (hashed, then dropped) and, at the end, the rest of the file
(``FileHashes.finish``). Bytes fetched before by small reads (``Kept``) are taken from memory.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from collections.abc import Iterable, Iterator

from .remote_path import RemotePath
from .stream import RangeStream, runs


class FileHashes:
    """Hashes of whole remote files, each fed with the file's bytes in order, wherever they were fetched.

    Bytes that arrive ahead of what a hash needs next (a reader that takes a file's tensors out of
    order) are kept (``store.kept``, within its budget) and hashed when the hash gets there; bytes
    dropped from there are fetched again by ``finish``: more bytes, never a wrong hash.
    """

    def __init__(self, algorithms: dict[RemotePath, str]):
        self._hash = {path: hashlib.new(algorithm) for path, algorithm in algorithms.items()}
        self._at = dict.fromkeys(algorithms, 0)  # the next byte each hash needs
        self._planned = dict.fromkeys(algorithms, 0)  # the bytes before it are planned to be read

    def feed(self, path: RemotePath, start: int, data) -> None:
        """Bytes ``data`` of ``path`` at ``start``: what its hash needs next is hashed, what is ahead kept."""
        at = self._at.get(path)
        if at is None or start + len(data) <= at:
            return
        kept = path._store.kept
        if start > at:
            kept.keep(path.path, start, bytes(data))
            return
        digest = self._hash[path]
        digest.update(memoryview(data)[at - start :])
        at = start + len(data)
        while spans := kept.overlapping(path.path, at, at + 1):  # bytes that came ahead of the hash
            span_start, span = max(spans, key=lambda s: s[0] + len(s[1]))
            digest.update(memoryview(span)[at - span_start :])
            at = span_start + len(span)
        self._at[path] = at

    def plan(self, ranges: list[tuple[RemotePath, int, int]]) -> Iterator[tuple[RemotePath, int, int]]:
        """``ranges``, in the order they will be read, each preceded by the bytes of a hashed file before
        it that neither an earlier range nor a later one reads: a stream of these gives every byte once."""
        wanted: dict[RemotePath, list[tuple[int, int]]] = {}
        for path, start, end in ranges:
            if path in self._planned:
                wanted.setdefault(path, []).append((start, end))
        merged = {path: list(merged_spans(spans)) for path, spans in wanted.items()}
        for path, start, end in ranges:
            planned = self._planned.get(path)
            if planned is not None:
                for a, b in _outside(planned, start, merged[path]):
                    yield path, a, b
                self._planned[path] = max(planned, end)
            yield path, start, end

    def replan(self) -> None:
        """A planned stream was dropped before its end: plan again from what was really hashed."""
        self._planned = dict(self._at)

    def finish(self) -> dict[RemotePath, str]:
        """Each file's hash (hex), the bytes not hashed yet taken from memory or fetched now; each is
        remembered (``known_hash``), so that no later check of the command reads the file again for it."""
        rest = [(path, at, path.stat().st_size) for path, at in self._at.items()]
        with RangeStream(rest) as stream:
            while (piece := stream.next()) is not None:
                self.feed(*piece)
        out = {path: digest.hexdigest() for path, digest in self._hash.items()}
        for path, hex_ in out.items():
            remember_hash(path, self._hash[path].name, hex_)
        return out


def known_hash(path: RemotePath, algorithm: str) -> str | None:
    """The hash (hex) of a remote file computed earlier in this command from the version it reads, if any:
    a checkpoint index lists a file in several places (a domain, its expert files), each checking its hash."""
    return path._store.hashed.get((path.path, algorithm))


def remember_hash(path: RemotePath, algorithm: str, hex_: str) -> None:
    path._store.hashed[(path.path, algorithm)] = hex_


def merged_spans(spans: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """``[start, end)`` spans, sorted, those that overlap or touch joined."""
    run = None
    for start, end in sorted(spans):
        if run is not None and start <= run[1]:
            run = (run[0], max(run[1], end))
            continue
        if run is not None:
            yield run
        run = (start, end)
    if run is not None:
        yield run


def _outside(start: int, end: int, merged: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of ``[start, end)`` no span of ``merged`` (sorted, disjoint) covers."""
    at = start
    for a, b in merged[max(0, bisect.bisect_right(merged, (start,)) - 1) :]:
        if a >= end:
            break
        if b <= at:
            continue
        if a > at:
            yield at, a
        at = max(at, b)
    if at < end:
        yield at, end


class HashingStream:
    """A ``RangeStream`` of ``ranges`` that also fetches the bytes between them in the files of
    ``hashes``, feeding each file's hash on the way: ``next()`` and ``peek()`` give only the ranges asked for."""

    def __init__(self, ranges: Iterable[tuple[RemotePath, int, int]], hashes: FileHashes):
        wanted = list(runs(ranges))
        self._wanted = deque(wanted)
        self._hashes = hashes
        self._stream = RangeStream(hashes.plan(wanted))
        self._piece: tuple[RemotePath, int, memoryview] | None = None  # the unread rest of the last piece
        self._ready: tuple[RemotePath, int, memoryview] | None = None

    def peek(self) -> tuple[RemotePath, int] | None:
        if self._ready is None:
            self._ready = self._take()
        return None if self._ready is None else self._ready[:2]

    def next(self) -> tuple[RemotePath, int, memoryview] | None:
        if self._ready is None:
            self._ready = self._take()
        ready, self._ready = self._ready, None
        return ready

    def _take(self) -> tuple[RemotePath, int, memoryview] | None:
        while self._wanted:
            if self._piece is None:
                got = self._stream.next()
                if got is None:
                    return None
                self._hashes.feed(*got)
                self._piece = (got[0], got[1], memoryview(got[2]))
            path, start, data = self._piece
            want_path, want_start, want_end = self._wanted[0]
            end = start + len(data)
            if path != want_path or end <= want_start:
                self._piece = None  # fetched only to be hashed
                continue
            if start < want_start:
                data, start = data[want_start - start :], want_start
            stop = min(end, want_end)
            self._piece = (path, stop, data[stop - start :]) if stop < end else None
            if stop == want_end:
                self._wanted.popleft()
            else:
                self._wanted[0] = (want_path, stop, want_end)
            return path, start, data[: stop - start]
        return None

    def close(self) -> None:
        self._stream.close()
        if self._wanted:
            self._hashes.replan()

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
