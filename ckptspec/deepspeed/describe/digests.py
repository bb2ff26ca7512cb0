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
from pathlib import Path
from typing import NamedTuple

from ... import split
from ..._forked import Forked
from ...format.dtypes import ITEMSIZE
from ...format.models import Digest, Locator, Manifest, ModelWeightsLocator, StateLocator, TensorLocator
from ...format.partition import param_pieces
from ...location import RangeStream, RemotePath, location

ALGORITHM = "sha256"  # the one algorithm of format 1.1 (a later minor may add others)
_CHUNK = 16 << 20  # a large tensor is read this many bytes at a time
_HEX = 64  # characters of a sha256 hexdigest
_FORK_ABOVE = 20_000  # digests below this are done before a child process would start
_BLOCK = 1 << 20  # small tensors are hashed from blocks of this many bytes, each read once
_BLOCKS_KEPT = 16  # blocks kept at once: each kind of tensor (masters, weights, moments) reads its own


class Covered(NamedTuple):
    """One digested tensor: where its digest goes in the manifest and the byte ranges it covers, in order."""

    where: tuple  # JSON path parts of the digest field: ("groups", 0, "params", 2, "state_digests", "exp_avg")
    ranges: tuple[tuple[str, int, int], ...]  # (file path as listed, absolute offset, bytes)


def _span(path: str, loc, start: int, count: int) -> tuple[str, int, int]:
    item = ITEMSIZE[loc.dtype]
    return path, loc.data_offset + (loc.element_offset + start) * item, count * item


def covered_tensors(manifest: Manifest) -> Iterator[Covered]:
    """Every tensor the manifest's locators cover completely, with the ranges of its real elements."""
    # (group, rank[, state]) or group or name -> (file, locator): [(rank, file, locator)] for a name
    masters: dict[tuple[int, int], tuple[str, Locator]] = {}
    states: dict[tuple[int, int, str], tuple[str, StateLocator]] = {}
    weights: dict[int, tuple[str, ModelWeightsLocator]] = {}
    named: dict[str, list[tuple[int, str, TensorLocator]]] = {}
    for f in manifest.files:
        for loc in f.partitions:
            masters[(loc.group, loc.rank)] = (f.path, loc)
        for state_loc in f.state_partitions or ():
            states[(state_loc.group, state_loc.rank, state_loc.state)] = (f.path, state_loc)
        for weights_loc in f.model_weights or ():
            weights[weights_loc.group] = (f.path, weights_loc)
        for tensor_loc in f.tensors or ():
            named.setdefault(tensor_loc.name, []).append((f.ranks[0] if len(f.ranks) == 1 else 0, f.path, tensor_loc))
    for g, group in enumerate(manifest.groups):
        keys = sorted({s for (gg, r, s) in states if gg == g and r == 0})
        count = group.partition_count
        # A kind of partition present at every rank covers every param: no per-param check then.
        every_master = all((g, r) in masters for r in range(count))
        every_state = {key: all((g, r, key) in states for r in range(count)) for key in keys}
        for i, p in enumerate(group.params):
            pieces = param_pieces(group.partitioning, count, group.partition_numel, p.offset, p.numel, p.padding)
            at = ("groups", g, "params", i)
            if (every_master or all((g, r) in masters for r, _, _ in pieces)) and (pieces or masters):
                yield Covered((*at, "digest"), tuple([_span(*masters[(g, r)], s, n) for r, s, n in pieces]))
            if g in weights:
                yield Covered((*at, "model_digest"), (_span(*weights[g], p.offset, p.numel),) if p.numel else ())
            for key in keys:
                if every_state[key] or all((g, r, key) in states for r, _, _ in pieces):
                    spans = tuple([_span(*states[(g, r, key)], s, n) for r, s, n in pieces])
                    yield Covered((*at, "state_digests", key), spans)
    for section in ("frozen", "buffers"):
        for i, t in enumerate(getattr(manifest, section)):
            found = sorted(named.get(t.name, []), key=lambda x: x[0])
            if found:
                yield Covered((section, i, "digest"), tuple(_span(path, loc, 0, loc.numel) for _, path, loc in found))


def digest_of(covered: Covered, tag_dir: Path | RemotePath, fds: dict[str, int]) -> str:
    """The SHA-256 of the covered bytes, read in chunks (``fds``: open files by listed path, reused)."""
    digest = hashlib.sha256()
    if isinstance(tag_dir, RemotePath):  # fetched in ranges, a few ahead
        ranges = [(tag_dir / path, offset, offset + nbytes) for path, offset, nbytes in covered.ranges]
        with RangeStream(ranges) as stream:
            while (piece := stream.next()) is not None:
                digest.update(piece[2])
        return digest.hexdigest()
    for path, offset, nbytes in covered.ranges:
        done = 0
        while done < nbytes:
            chunk = os.pread(_fd(fds, tag_dir, path), min(_CHUNK, nbytes - done), offset + done)
            if not chunk:
                raise OSError(f"{path} ends before byte {offset + nbytes}")
            digest.update(chunk)
            done += len(chunk)
    return digest.hexdigest()


def _fd(fds: dict[str, int], tag_dir: Path, path: str) -> int:
    if path not in fds:
        fds[path] = os.open(tag_dir / path, os.O_RDONLY)
    return fds[path]


def digests_of(covered: list[Covered], tag_dir: str | os.PathLike | RemotePath) -> list[str]:
    """``[digest_of(c) for c in covered]``, read and hashed faster on a local disk: a tensor that lies
    in one block of ``_BLOCK`` bytes is hashed from that block, read once (a 100k-tensor checkpoint has
    388k digests of a few hundred bytes: a read each cost more than the hashing), and a second CPU
    takes every other tensor (hashlib holds the GIL below 2 KiB; alternate ones spread large tensors).
    The ranks of a torchrun split (``ckptspec.split``) each hash a share of them."""
    share = split.current()
    where = location(tag_dir)
    if isinstance(where, Path) and split.looking_up():  # rank 0's commit: what the ranks hashed before
        return _remembered_or_hashed(covered, where)
    split.count_read(sum(nbytes for c in covered[share.rank :: share.size] for _, _, nbytes in c.ranges))
    found = share.map_split(lambda mine: _digests(list(mine), where), covered)
    if share.size > 1 and isinstance(where, Path):  # for rank 0's commit, which digests the files again
        for c, sha256 in zip(covered, found):
            split.remember(_key(c, where), sha256)
    return found


def _key(covered: Covered, tag_dir: Path) -> tuple:
    return tuple((split.file_identity(tag_dir / path), offset, nbytes) for path, offset, nbytes in covered.ranges)


def _remembered_or_hashed(covered: list[Covered], tag_dir: Path) -> list[str]:
    known = [split.remembered(_key(c, tag_dir)) for c in covered]
    missing = [c for c, sha256 in zip(covered, known) if sha256 is None]
    split.count_read(sum(nbytes for c in missing for _, _, nbytes in c.ranges))
    hashed = iter(_digests(missing, tag_dir))
    return [sha256 if sha256 is not None else next(hashed) for sha256 in known]


def _digests(covered: list[Covered], tag_dir: Path | RemotePath) -> list[str]:
    if isinstance(tag_dir, RemotePath):
        return [digest_of(c, tag_dir, {}) for c in covered]
    if len(covered) < _FORK_ABOVE:
        return _local_digests(covered, tag_dir)
    theirs = covered[1::2]
    with Forked(lambda: "".join(_local_digests(theirs, tag_dir)).encode("ascii")) as child:
        mine = _local_digests(covered[0::2], tag_dir)
        sent = child.result()
    if sent is None or len(sent) != _HEX * len(theirs):  # no child, or it failed: do it here
        others = _local_digests(theirs, tag_dir)
    else:
        text = sent.decode("ascii")
        others = [text[i : i + _HEX] for i in range(0, len(text), _HEX)]
    out = [""] * len(covered)
    out[0::2], out[1::2] = mine, others
    return out


def _local_digests(covered: list[Covered], tag_dir: Path) -> list[str]:
    out: list[str] = []
    fds: dict[str, int] = {}  # file -> its open descriptor
    blocks: dict[tuple[str, int], memoryview] = {}  # (file, block number) -> its bytes
    sha256 = hashlib.sha256
    try:
        for c in covered:
            if len(c.ranges) == 1:
                path, offset, nbytes = c.ranges[0]
                block = offset // _BLOCK
                if (offset + nbytes - 1) // _BLOCK == block:  # the same block holds it whole
                    key = (path, block)
                    data = blocks.get(key)
                    if data is None:
                        if len(blocks) >= _BLOCKS_KEPT:  # a few files read side by side; memory stays bounded
                            blocks.clear()
                        data = blocks[key] = memoryview(os.pread(_fd(fds, tag_dir, path), _BLOCK, block * _BLOCK))
                    start = offset - block * _BLOCK
                    if start + nbytes <= len(data):
                        out.append(sha256(data[start : start + nbytes]).hexdigest())
                        continue
            out.append(digest_of(c, tag_dir, fds))  # several ranges, a large tensor, or one past the end
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def recorded(manifest: Manifest, where: tuple) -> Digest | None:
    """The digest the manifest records at ``where``, or None."""
    if where[0] == "groups":
        param = manifest.groups[where[1]].params[where[3]]
        if where[4] == "state_digests":
            return (param.state_digests or {}).get(where[5])
        return getattr(param, where[4])
    return getattr(manifest, where[0])[where[1]].digest


def record_digests(manifest: Manifest, found: list[tuple[tuple, str]]) -> None:
    """Set the digest at each ``where`` (a ``Covered.where``), each param's optimizer states in one dict."""
    made = [Digest(sha256=sha256) for _, sha256 in found]
    by_field: dict[str, tuple[list, list]] = {}  # field -> (models, digests)
    states: dict[int, tuple] = {}  # id(param) -> (param, its state digests)
    for (where, _), value in zip(found, made):
        if where[0] != "groups":
            model, field = getattr(manifest, where[0])[where[1]], "digest"
        else:
            model, field = manifest.groups[where[1]].params[where[3]], where[4]
            if field == "state_digests":
                states.setdefault(id(model), (model, {**(model.state_digests or {})}))[1][where[5]] = value
                continue
        models, values = by_field.setdefault(field, ([], []))
        models.append(model)
        values.append(value)
    by_field["state_digests"] = ([p for p, _ in states.values()], [d for _, d in states.values()])
    for field, (models, values) in by_field.items():
        for model, value in zip(models, values):
            setattr(model, field, value)


def add_digests(manifest: Manifest, tag_dir: str | os.PathLike | RemotePath) -> list[tuple[tuple, str]]:
    """Record the digest of every tensor the manifest locates (reads each of their bytes once);
    returns them, ``(where, sha256)`` in the order recorded (for ``record_digests`` elsewhere)."""
    covered = list(covered_tensors(manifest))
    found = [(c.where, sha256) for c, sha256 in zip(covered, digests_of(covered, tag_dir))]
    record_digests(manifest, found)
    return found
