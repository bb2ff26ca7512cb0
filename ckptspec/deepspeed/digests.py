"""Format 1.1's per-tensor digests: which bytes each one covers, computing them, checking them.

A digest covers a tensor's real elements only, in C order, as stored (little-endian, the
stored dtype): a trainable parameter's fp32 master assembled from its groups' partitions
(``digest``), its low-precision weights in the flat group (``model_digest``), each optimizer
state of it (``state_digests``), a frozen parameter (its stage-3 fragments concatenated in rank
order and trimmed) and a buffer (``digest``). Padding is never covered: it is not reproducible
(stage 3 leaves it uninitialised), so a byte flipped in padding changes no digest and one
flipped in a real element changes exactly one (docs/spec.md#digests).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..format.dtypes import ITEMSIZE
from ..format.models import Digest, Manifest
from ..format.partition import param_pieces
from ..location import RangeStream, RemotePath, location

ALGORITHM = "sha256"  # the one algorithm of format 1.1 (a later minor may add others)
_CHUNK = 16 << 20


@dataclass(frozen=True)
class Covered:
    """One digested tensor: where its digest goes in the manifest and the byte ranges it covers, in order."""

    where: tuple  # JSON path parts of the digest field: ("groups", 0, "params", 2, "state_digests", "exp_avg")
    ranges: tuple[tuple[str, int, int], ...]  # (file path as listed, absolute offset, bytes)


def _span(path: str, loc, start: int, count: int) -> tuple[str, int, int]:
    item = ITEMSIZE[loc.dtype]
    return path, loc.data_offset + (loc.element_offset + start) * item, count * item


def covered_tensors(manifest: Manifest) -> Iterator[Covered]:
    """Every tensor the manifest's locators cover completely, with the ranges of its real elements."""
    masters, states, weights, named = {}, {}, {}, {}
    for f in manifest.files:
        for loc in f.partitions:
            masters[(loc.group, loc.rank)] = (f.path, loc)
        for loc in f.state_partitions or ():
            states[(loc.group, loc.rank, loc.state)] = (f.path, loc)
        for loc in f.model_weights or ():
            weights[loc.group] = (f.path, loc)
        for loc in f.tensors or ():
            named.setdefault(loc.name, []).append((f.ranks[0] if len(f.ranks) == 1 else 0, f.path, loc))
    for g, group in enumerate(manifest.groups):
        keys = sorted({s for (gg, r, s) in states if gg == g and r == 0})
        for i, p in enumerate(group.params):
            pieces = param_pieces(
                group.partitioning, group.partition_count, group.partition_numel, p.offset, p.numel, p.padding
            )
            at = ("groups", g, "params", i)
            if all((g, r) in masters for r, _, _ in pieces) and (pieces or masters):
                yield Covered((*at, "digest"), tuple(_span(*masters[(g, r)], s, n) for r, s, n in pieces))
            if g in weights:
                yield Covered((*at, "model_digest"), (_span(*weights[g], p.offset, p.numel),) if p.numel else ())
            for key in keys:
                if all((g, r, key) in states for r, _, _ in pieces):
                    spans = tuple(_span(*states[(g, r, key)], s, n) for r, s, n in pieces)
                    yield Covered((*at, "state_digests", key), spans)
    for section in ("frozen", "buffers"):
        for i, t in enumerate(getattr(manifest, section)):
            found = sorted(named.get(t.name, []), key=lambda x: x[0])
            if found:
                yield Covered((section, i, "digest"), tuple(_span(path, loc, 0, loc.numel) for _, path, loc in found))


def digest_of(covered: Covered, tag_dir: Path | RemotePath, fds: dict[str, int]) -> str:
    """The SHA-256 of the covered bytes, read in chunks (``fds``: open files by listed path, reused)."""
    digest = hashlib.new(ALGORITHM)
    if isinstance(tag_dir, RemotePath):  # fetched in ranges, a few ahead
        ranges = [(tag_dir / path, offset, offset + nbytes) for path, offset, nbytes in covered.ranges]
        with RangeStream(ranges) as stream:
            while (piece := stream.next()) is not None:
                digest.update(piece[2])
        return digest.hexdigest()
    for path, offset, nbytes in covered.ranges:
        if path not in fds:
            fds[path] = os.open(tag_dir / path, os.O_RDONLY)
        done = 0
        while done < nbytes:
            chunk = os.pread(fds[path], min(_CHUNK, nbytes - done), offset + done)
            if not chunk:
                raise OSError(f"{path} ends before byte {offset + nbytes}")
            digest.update(chunk)
            done += len(chunk)
    return digest.hexdigest()


def recorded(manifest: Manifest, where: tuple) -> Digest | None:
    """The digest the manifest records at ``where``, or None."""
    if where[0] == "groups":
        param = manifest.groups[where[1]].params[where[3]]
        if where[4] == "state_digests":
            return (param.state_digests or {}).get(where[5])
        return getattr(param, where[4])
    return getattr(manifest, where[0])[where[1]].digest


def record_digest(manifest: Manifest, where: tuple, value: Digest) -> None:
    """Set the digest at ``where`` (a ``Covered.where``)."""
    if where[0] == "groups":
        param = manifest.groups[where[1]].params[where[3]]
        if where[4] == "state_digests":
            param.state_digests = {**(param.state_digests or {}), where[5]: value}
        else:
            setattr(param, where[4], value)
    else:
        getattr(manifest, where[0])[where[1]].digest = value


def add_digests(manifest: Manifest, tag_dir: str | os.PathLike) -> list[tuple[tuple, str]]:
    """Record the digest of every tensor the manifest locates (reads each of their bytes once);
    returns them, ``(where, sha256)`` in the order recorded (for ``record_digest`` elsewhere)."""
    fds: dict[str, int] = {}
    done = []
    try:
        for covered in covered_tensors(manifest):
            sha256 = digest_of(covered, location(tag_dir), fds)
            record_digest(manifest, covered.where, Digest(sha256=sha256))
            done.append((covered.where, sha256))
    finally:
        for fd in fds.values():
            os.close(fd)
    return done
