"""What each model tensor of an FSDP checkpoint (torch DCP) is besides the trained parameters: a frozen parameter, a
tie's second name, or a buffer. DCP records none of it (every model entry is a tensor under its name); read here
from how FSDP saved them:

* FSDP shards parameters, never buffers: an entry saved in more than one chunk (each rank's ``Shard(0)`` rows) is a
  parameter, one saved whole by one rank a buffer;
* a parameter the param groups do not name is frozen, unless it is a trained parameter under a second name (a tie:
  ``state_dict`` saves the one parameter under both names, DCP writes each apart): saved in the same chunks with the
  same dtype and bytes as a trained parameter (compared where the chunks and dtype match: their first 64 KiB, then,
  where those are equal, the sha256 of the whole; each tensor read at most once each way).

A save of one rank holds every entry whole: its frozen parameters are not told from buffers (listed as buffers and
as ``unsure``: a ZeRO-3 target, which keeps them apart, is refused; a tie is still found by its bytes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..checkpoint.dcp.metadata import TensorEntry
from ..location import open_binary
from .model_plan import Segment, TensorSource

CHUNK = 16 * 1024 * 1024  # bytes hashed per read
HEAD = 64 * 1024  # compared before a whole tensor is hashed: a frozen layer shaped as a trained one differs early


@dataclass
class ModelRoles:
    frozen: list[str] = field(default_factory=list)  # in the module's order
    buffers: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # a tie's second name -> its trained owner
    unsure: list[str] = field(default_factory=list)  # buffers that may be frozen parameters (no parameter sharded)


def _sharded(entry: TensorEntry) -> bool:
    """Saved as rows of several ranks (FSDP's ``Shard(0)``), not whole by one."""
    whole = len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.size and not any(entry.chunks[0].offsets)
    return not whole


def _digest(segments: list[Segment], limit: int | None = None) -> str:
    """The sha256 of the segments' bytes (their first ``limit`` bytes)."""
    h, budget = hashlib.sha256(), limit
    for seg in segments:
        with open_binary(seg.path) as fh:  # a URL: ranged reads
            fh.seek(seg.offset)
            left = seg.nbytes if budget is None else min(seg.nbytes, budget)
            while left:
                data = fh.read(min(left, CHUNK))
                if not data:
                    break
                h.update(data)
                left -= len(data)
                budget = None if budget is None else budget - len(data)
    return h.hexdigest()


def model_roles(
    entries: dict[str, TensorEntry], trained: dict[str, TensorSource], located: dict[str, TensorSource]
) -> ModelRoles:
    """``entries``: every model tensor's DCP entry, by name; ``trained``: the trained parameters' masters;
    ``located``: every other model tensor's bytes."""
    roles = ModelRoles()
    digests: dict[tuple[str, int | None], str] = {}

    def digest(source: TensorSource, limit: int | None = None) -> str:
        if (source.name, limit) not in digests:
            digests[(source.name, limit)] = _digest(list(source.segments), limit)
        return digests[(source.name, limit)]

    def same_bytes(a: TensorSource, b: TensorSource) -> bool:
        return digest(a, HEAD) == digest(b, HEAD) and digest(a) == digest(b)

    for name, source in located.items():
        chunks = entries[name].chunks
        same = [t for t in trained.values() if entries[t.name].chunks == chunks and t.dtype == source.dtype]
        owner = next((t.name for t in same if same_bytes(t, source)), None)
        if owner is not None:
            roles.aliases[name] = owner
        elif _sharded(entries[name]):
            roles.frozen.append(name)
        else:
            roles.buffers.append(name)
    if not any(_sharded(entries[name]) for name in trained):  # every parameter whole too: the rule tells nothing
        roles.unsure = list(roles.buffers)
    return roles
