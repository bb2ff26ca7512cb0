"""A model-states file as it was before ``ckptspec embed`` added its manifest: its size and hash.

``embed`` appends ``client_state[ckptspec_manifest] = ...`` to ``data.pkl`` and copies every
other record byte for byte (``pt_rewrite``); only the zip's headers around them change. The file
it rewrote is therefore the same records, ``data.pkl`` without the appended item, in the layout
``torch.save`` writes (``torch_zip``). Its size (and its hash) against a manifest's record of the
file tells a manifest written before the embed (stale: the file is intact, CK227) from a file
that changed (CK208, CK209). A file that was not written by ``torch.save`` simply does not match.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..location import RemotePath, open_binary
from .pt_rewrite import pickles_before
from .torch_zip import TorchZipWriter

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Earlier:
    """The file before one embed (``embeds`` embeds ago): its ``data.pkl`` and its size."""

    embeds: int
    pkl: bytes
    size: int


class _Sink:
    """What the writer writes, hashed (or only counted: ``algorithm`` None)."""

    def __init__(self, algorithm: str | None):
        self.hash = hashlib.new(algorithm) if algorithm else None

    def write(self, data) -> None:
        if self.hash is not None:
            self.hash.update(data)


def _records(members: dict[str, tuple[int, int]]) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every record, in the file's order."""
    return sorted(((name, offset, size) for name, (offset, size) in members.items()), key=lambda r: r[1])


def _rebuild(members, pkl: bytes, algorithm: str | None, handle=None) -> tuple[int, str | None]:
    """Size and hash (None when only measuring) of the file with ``data.pkl`` replaced by ``pkl``."""
    records = _records(members)
    archive = records[0][0].split("/", 1)[0]
    sink = _Sink(algorithm)
    writer = TorchZipWriter(Path(f"{archive}.pt"), sink=sink, archive=archive)
    for name, offset, size in records:
        short = name.split("/", 1)[1]
        if short == "data.pkl":
            writer.write_record(short, pkl, len(pkl))
        else:
            writer.write_record(short, None if handle is None else _chunks(handle, offset, size), size)
    writer.finish()
    return writer.written, sink.hash.hexdigest() if sink.hash is not None else None


def _chunks(handle, offset: int, size: int):
    handle.seek(offset)
    while size > 0:
        chunk = handle.read(min(_CHUNK, size))
        if not chunk:
            raise OSError(f"the file ends {size} bytes early")
        size -= len(chunk)
        yield chunk


def before_embed(path: Path | RemotePath, members: dict[str, tuple[int, int]], key: str) -> list[Earlier]:
    """The file before each embed of ``key`` that rewrote it, the latest first (sizes computed, nothing
    read but ``data.pkl``); empty when ``data.pkl`` does not end with an appended item."""
    pkl_name = next((n for n in members if n.endswith("/data.pkl") and n.count("/") == 1), None)
    if pkl_name is None:
        return []
    offset, size = members[pkl_name]
    with open_binary(path) as handle:
        handle.seek(offset)
        data = handle.read(size)
    return [Earlier(k + 1, pkl, _rebuild(members, pkl, None)[0]) for k, pkl in enumerate(pickles_before(data, key))]


def hash_before_embed(
    path: Path | RemotePath, members: dict[str, tuple[int, int]], earlier: Earlier, algorithm: str
) -> str:
    """The hash of ``earlier``'s file, its records read from ``path`` (one pass over the file)."""
    with open_binary(path) as handle:
        digest = _rebuild(members, earlier.pkl, algorithm, handle)[1]
    assert digest is not None  # an algorithm given: hashed, not only measured
    return digest


def recorded_before_embed(
    path: Path | RemotePath, members: dict[str, tuple[int, int]], key: str, size: int, hash_=None
) -> tuple[Earlier | None, int]:
    """(the earlier file that is the recorded one, or None; how many embeds the file carries).

    The recorded file is ``size`` bytes, and has ``hash_`` (a ``format.models.Hash``) when given:
    then the earlier file's bytes are hashed too (one pass over the file), else its size alone
    matches, as the recorded size alone is all a manifest without hashes can check."""
    earlier = before_embed(path, members, key)
    same_size = [e for e in earlier if e.size == size]
    for candidate in same_size:
        if hash_ is None or hash_before_embed(path, members, candidate, hash_.algorithm) == hash_.digest:
            return candidate, len(earlier)
    return None, len(earlier)
