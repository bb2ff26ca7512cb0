"""Format 1.1's per-tensor digests in a domain whose checkpoint index locates its masters (issue #39:
ZeRO stage 0, native MoE, the stage-0 pipeline, universal folders), written by ``generate --hash``.

The domain's manifest (format 1.1) gives each parameter the ``digest`` of its fp32 master: sha256 over
its master locators' bytes, in order (the real elements as stored, docs/spec.md#digests), and
``state_digests``: the same over each optimizer state at the master's positions
(``layout/moments.py``, the ranges ``reconstruct --optimizer-state`` reads). A domain whose moments
cannot be located gets master digests only. Readers check them as the bytes stream
(``export/arrays.py``, CK222).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ...checkpoint.states import StateCache
from ...errors import UnsupportedCheckpoint
from ...format.dtypes import ITEMSIZE
from ...format.index_models import Domain
from ...format.models import Digest
from ...location import RemotePath, read_range
from ..layout.moments import MomentFinder

_CHUNK = 16 << 20


def sha256_of(folder: Path | RemotePath, ranges: list[tuple[str, int, int]]) -> str:
    """sha256 over the bytes of ``ranges`` (file relative to ``folder``, absolute offset, count), in order."""
    digest = hashlib.sha256()
    for rel, offset, nbytes in ranges:
        while nbytes > 0:  # read_range: a local pread, or a URL's bytes fetched once
            chunk = read_range(folder / rel, offset, min(nbytes, _CHUNK))
            if not chunk:
                raise UnsupportedCheckpoint(f"{rel} ends inside a located tensor", "the file is truncated", rel)
            digest.update(chunk)
            offset, nbytes = offset + len(chunk), nbytes - len(chunk)
    return digest.hexdigest()


def moment_ranges(folder: Path | RemotePath, states: StateCache, domain: Domain) -> dict[str, dict[str, list]] | None:
    """param -> state -> its byte ranges, or None where the moments cannot be located (``--optimizer-state``
    refuses them by name: they get no digest either). A universal folder's ``exp_avg.pt`` are not located."""
    assert domain.masters is not None
    finder = MomentFinder(folder, states)
    out: dict[str, dict[str, list]] = {}
    try:
        for loc in domain.masters.tensors:
            found = finder.locate(loc.param, loc.file, list(loc.key), loc.element_offset, loc.numel)
            for key, (offset, nbytes, _) in found.ranges.items():
                out.setdefault(loc.param, {}).setdefault(key, []).append((found.file, offset, nbytes))
    except UnsupportedCheckpoint:
        return None
    return out


def master_ranges(domain: Domain) -> dict[str, list[tuple[str, int, int]]]:
    """param -> the byte ranges of its master's locators, in order."""
    assert domain.masters is not None
    out: dict[str, list[tuple[str, int, int]]] = {}
    for loc in domain.masters.tensors:
        item = ITEMSIZE[loc.dtype]
        out.setdefault(loc.param, []).append((loc.file, loc.data_offset + loc.element_offset * item, loc.numel * item))
    return out


def add_masters_digests(folder: Path, states: StateCache, domain: Domain) -> None:
    """Set ``digest`` and ``state_digests`` of every parameter of ``domain``'s manifest."""
    assert domain.masters is not None
    masters = master_ranges(domain)
    moments = None if domain.masters.stored_in == "universal" else moment_ranges(folder, states, domain)
    for group in domain.manifest.groups:
        for p in group.params:
            if p.name in masters:
                p.digest = Digest(sha256=sha256_of(folder, masters[p.name]))
            if moments is not None and moments.get(p.name):
                p.state_digests = {k: Digest(sha256=sha256_of(folder, r)) for k, r in sorted(moments[p.name].items())}
