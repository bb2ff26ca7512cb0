"""Streaming content hashes of shard files."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from .. import split
from ..format.models import Hash
from ..location import RemotePath, iter_chunks, known_hash, remember_hash

ALGORITHMS = ("sha256", "blake2b")
_CHUNK = 1 << 20


def file_digest(path: str | Path | RemotePath, algorithm: str = "sha256") -> Hash:
    """Hash a file in 1 MiB chunks (constant memory); a remote file is fetched in ranges, a few ahead."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    name: Literal["sha256", "blake2b"] = "sha256" if algorithm == "sha256" else "blake2b"
    if isinstance(path, RemotePath):  # once per command: a file an index lists twice is hashed once
        known = known_hash(path, name)
        if known is None:
            digest = hashlib.new(algorithm)
            for chunk in iter_chunks(path):
                digest.update(chunk)
            remember_hash(path, name, known := digest.hexdigest())
        return Hash(algorithm=name, digest=known)
    key = (name, split.file_identity(path)) if split.looking_up() else None
    known = split.remembered(key) if key is not None else None
    if known is None:
        with open(path, "rb") as fh:
            known = hashlib.file_digest(fh, algorithm).hexdigest()
            split.count_read(fh.tell())
    return Hash(algorithm=name, digest=known)


def file_digests(paths: list, algorithm: str = "sha256", jobs: int | None = None) -> list[Hash]:
    """``file_digest`` of each path, in order, several files at once: hashlib releases the GIL
    while it hashes, so threads use every core (``jobs``: at most this many, default one per CPU).
    The first error, in the order of ``paths``, is raised. The ranks of a torchrun split each hash a share."""
    share, paths = split.current(), list(paths)
    found = share.map_split(lambda mine: _file_digests(list(mine), algorithm, jobs), paths)
    if share.size > 1:  # for rank 0's commit, which hashes the files again
        for path, h in zip(paths, found):
            if not isinstance(path, RemotePath):
                split.remember((h.algorithm, split.file_identity(path)), h.digest)
    return found


def _file_digests(paths: list, algorithm: str, jobs: int | None) -> list[Hash]:
    workers = min(jobs or os.cpu_count() or 1, len(paths))
    if workers <= 1 or any(isinstance(p, RemotePath) for p in paths):  # URLs: one range reader at a time
        return [file_digest(p, algorithm) for p in paths]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: file_digest(p, algorithm), paths))
