"""A remote checkpoint's file hashes (CK209) and tensor digests (CK222) from one read of its bytes.

Over a network each byte is fetched once: the files whose hash is recorded are read whole, front
to back, in the manifest's order (what validation already fetched of them, the zip directories
and pickles, comes from memory: ``location.Kept``), the other files only where digested tensors
are; every piece goes to its file's hash and to the digest of each tensor it holds part of. A
tensor whose pieces do not come in its order (none in a DeepSpeed checkpoint: a master's pieces
are in rank order, as the files are) is read again on its own, afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ....location import FileHashes, RangeStream, RemotePath, known_hash, merged_spans
from ...describe.digests import Covered, digest_of


@dataclass
class _Digest:
    """One covered tensor's digest as its bytes arrive: the range it needs next, and how far into it."""

    ranges: list[tuple[str, int, int]]  # (file, offset, bytes): its non-empty ranges, in order
    next: int = 0
    done: int = 0
    sha: Any = field(default=None, repr=False)  # a hashlib sha256 while bytes arrive
    hex: str | None = None  # once complete
    broken: bool = False

    def __post_init__(self) -> None:
        if not self.ranges:
            self.hex = hashlib.sha256().hexdigest()

    def feed(self, k: int, at: int, piece) -> None:
        """Bytes ``piece`` of range ``k``, ``at`` bytes into it."""
        if self.broken or k != self.next or at != self.done:
            self.broken, self.sha = True, None  # out of order: read on its own later
            return
        if self.sha is None:
            self.sha = hashlib.sha256()
        self.sha.update(piece)
        self.done += len(piece)
        if self.done == self.ranges[k][2]:
            self.next, self.done = k + 1, 0
            if self.next == len(self.ranges):
                self.hex, self.sha = self.sha.hexdigest(), None  # complete: its hash object goes now


def _taps(digests: list[_Digest]) -> dict[str, list[tuple[int, int, int, int]]]:
    """file -> (start, end, digest index, range index) of every digested range, by start."""
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for i, d in enumerate(digests):
        for k, (path, offset, nbytes) in enumerate(d.ranges):
            out.setdefault(path, []).append((offset, offset + nbytes, i, k))
    for taps in out.values():
        taps.sort()
    return out


class _Tapper:
    """Hands each piece of one file to the digests whose ranges it overlaps (pieces come in order)."""

    def __init__(self, taps: list[tuple[int, int, int, int]], digests: list[_Digest]):
        self.taps, self.digests, self.i = taps, digests, 0
        self.active: list = []

    def feed(self, start: int, data) -> None:
        end = start + len(data)
        while self.i < len(self.taps) and self.taps[self.i][0] < end:
            self.active.append(self.taps[self.i])
            self.i += 1
        still = []
        for tap in self.active:
            tap_start, tap_end, i, k = tap
            a, b = max(tap_start, start), min(tap_end, end)
            if a < b:
                self.digests[i].feed(k, a - tap_start, data[a - start : b - start])
            if tap_end > end:
                still.append(tap)
        self.active = still


def hashes_and_digests(
    tag_dir: RemotePath, files: list[str], hashed: Mapping[str, str], covered: list[Covered]
) -> tuple[dict[str, str], list[str]]:
    """({file: hex hash} of ``hashed`` (file -> algorithm), [sha256 of each ``covered``]), reading
    each byte once; ``files``: every file listed, in the manifest's order (the order they are read)."""
    digests = [_Digest([r for r in c.ranges if r[2] > 0]) for c in covered]
    taps = _taps(digests)
    paths = {name: tag_dir / name for name in files}
    # A file hashed earlier in the command (another domain of a checkpoint index lists it) is not read again.
    known = {name: h for name, algorithm in hashed.items() if (h := known_hash(paths[name], algorithm)) is not None}
    hashed = {name: algorithm for name, algorithm in hashed.items() if name not in known}
    hashes = FileHashes({paths[name]: algorithm for name, algorithm in hashed.items()})
    ranges = []
    for name in files:
        if name in hashed:
            ranges.append((paths[name], 0, paths[name].stat().st_size))
        elif name in taps:
            ranges += [(paths[name], a, b) for a, b in merged_spans([(t[0], t[1]) for t in taps[name]])]
    tappers = {paths[name]: _Tapper(found, digests) for name, found in taps.items() if name in paths}
    with RangeStream(ranges) as stream:
        while (piece := stream.next()) is not None:
            path, start, data = piece
            hashes.feed(path, start, data)
            if path in tappers:
                tappers[path].feed(start, memoryview(data))
    actual = hashes.finish()  # nothing left to fetch: every hashed file was read whole
    out = [d.hex if d.hex is not None and not d.broken else digest_of(c, tag_dir, {}) for c, d in zip(covered, digests)]
    return {**known, **{name: actual[paths[name]] for name in hashed}}, out
