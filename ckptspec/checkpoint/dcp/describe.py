"""The document of a torch DCP checkpoint (``"format": "ckptspec.dcp"``, docs/spec-dcp.md), made from its
``.metadata`` (read by the restricted reader, never run) and its files.

``describe_dcp`` checks the directory first (``checks.check_dcp``: CK250-CK254, CK204); one with an error finding is
not described (``CheckpointInvalid``). Each chunk's record is read through the restricted ``.pt`` reader for where
its elements start (``data_offset``); with a hash algorithm, every file and every chunk's elements are hashed too.
Standard library only.
"""

from __future__ import annotations

import math
from typing import Any

from ..._version import __version__
from ...errors import CheckpointInvalid, FileUnreadable
from ...findings import has_errors
from ...format.dcp_models import DCP_FORMAT, DCP_VERSION, DcpDocument
from ...format.dcp_rules import RANK_FILE
from ...format.dtypes import ITEMSIZE
from ...location import location, open_binary
from ..hashing import file_digest
from .checks import Where, check_dcp
from .digest import element_digest
from .metadata import METADATA_NAME, BytesEntry, DcpMetadata, Item, TensorEntry
from .records import read_record


def describe_dcp(directory: Where | str, hash_algorithm: str | None = None) -> DcpDocument:
    """The DCP document of the checked checkpoint in ``directory`` (a path or a URL: ranged reads through
    ``location``); raises ``CheckpointInvalid`` listing the findings of one that has errors (nothing described)."""
    directory = location(directory)
    meta, findings = check_dcp(directory)
    if has_errors(findings):
        raise CheckpointInvalid(findings, str(directory))
    doc: dict[str, Any] = {
        "format": DCP_FORMAT,
        "format_version": DCP_VERSION,
        "producer": {
            "tool": "ckptspec",
            "tool_version": __version__,
            "framework": "torch.distributed.checkpoint",
            "framework_version": meta.version or "unknown",
        },
    }
    world = saving_world_size(directory)
    if world is not None:
        doc["world_size"] = world
    doc["metadata"] = {"size": meta.size}
    if hash_algorithm:
        doc["metadata"]["hash"] = file_digest(directory / METADATA_NAME, hash_algorithm).model_dump()
    if meta.version:
        doc["metadata"]["version"] = meta.version
    doc["files"] = [_file(directory, name, hash_algorithm) for name in meta.files]
    doc["tensors"] = _tensors(directory, meta, bool(hash_algorithm))
    doc["bytes"] = [
        {"name": i.fqn, "file": i.file, "offset": i.offset, "length": i.length}
        for i in meta.items
        if i.chunk_offset is None and isinstance(meta.entries.get(i.fqn), BytesEntry)
    ]
    return DcpDocument.model_validate(doc)


def saving_world_size(directory: Where) -> int | None:
    """The saving job's world size, when the directory says it: ``FileSystemWriter`` writes ``__<rank>_<n>.distcp``
    on every rank, an empty one for a rank without items, so ranks 0 .. N-1 each with a file are a world of N; a
    gap in them (a file lost, or named otherwise) says nothing."""
    try:
        ranks = {int(m.group(1)) for p in directory.iterdir() if (m := RANK_FILE.match(p.name))}
    except OSError as exc:
        raise FileUnreadable(directory, exc) from None
    return len(ranks) if ranks and ranks == set(range(len(ranks))) else None


def _file(directory: Where, name: str, hash_algorithm: str | None) -> dict[str, Any]:
    path = directory / name
    try:
        out: dict[str, Any] = {"path": name, "size": path.stat().st_size}
    except OSError as exc:
        raise FileUnreadable(path, exc) from None
    if hash_algorithm:
        out["hash"] = file_digest(path, hash_algorithm).model_dump()
    return out


def _tensors(directory: Where, meta: DcpMetadata, digests: bool) -> list[dict[str, Any]]:
    items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    handles: dict[str, Any] = {}
    out = []
    try:
        for fqn, entry in meta.entries.items():
            if not isinstance(entry, TensorEntry):
                continue
            chunks = []
            for chunk in entry.chunks:
                item = items[(fqn, chunk.offsets)]
                fh = handles.get(item.file)
                if fh is None:
                    fh = handles[item.file] = open_binary(directory / item.file)  # closed below
                chunks.append(_chunk(fh, directory, item, chunk.sizes, entry.dtype, digests))
            out.append({"name": fqn, "dtype": entry.dtype, "shape": list(entry.size), "chunks": chunks})
    except OSError as exc:
        raise FileUnreadable(directory, exc) from None
    finally:
        for fh in handles.values():
            fh.close()
    return out


def _chunk(fh, directory: Where, item: Item, sizes: tuple[int, ...], dtype: str, digest: bool) -> dict[str, Any]:
    record = read_record(fh, directory / item.file, item.offset, item.length)  # checked by CK254 already
    out: dict[str, Any] = {
        "offsets": list(item.chunk_offset or ()),
        "sizes": list(sizes),
        "file": item.file,
        "offset": item.offset,
        "length": item.length,
        "data_offset": record.data_offset,
    }
    if digest:
        out["digest"] = {"sha256": element_digest(fh, record.data_offset, math.prod(sizes) * ITEMSIZE[dtype])}
    return out
