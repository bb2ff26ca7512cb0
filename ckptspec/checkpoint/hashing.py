"""Streaming content hashes of shard files."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..format.models import Hash
from ..location import RemotePath, iter_chunks

ALGORITHMS = ("sha256", "blake2b")
_CHUNK = 1 << 20


def file_digest(path: str | Path | RemotePath, algorithm: str = "sha256") -> Hash:
    """Hash a file in 1 MiB chunks (constant memory); a remote file is fetched in ranges, a few ahead."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    if isinstance(path, RemotePath):
        digest = hashlib.new(algorithm)
        for chunk in iter_chunks(path):
            digest.update(chunk)
        return Hash(algorithm=algorithm, digest=digest.hexdigest())
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, algorithm)
    return Hash(algorithm=algorithm, digest=digest.hexdigest())
