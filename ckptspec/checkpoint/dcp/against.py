"""A torch DCP checkpoint's files against its document (``validate DOC --checkpoint DCP_DIR``): one rule, one
function.

The directory is checked against its own ``.metadata`` first (``checks.check_dcp``: CK250-CK254, CK204), then:

- CK255 the document describes this save: its ``.metadata`` (size, and hash when recorded), every tensor, chunk,
  storage item and bytes item as ``.metadata`` has them, and each chunk's elements where its record puts them;
- CK256 every file the document lists has its size (and, when recorded and asked, its hash);
- CK257 every chunk's recorded digest is the sha256 of its elements (when asked).

A document of another save (an older save into the same directory, a copy of another directory) is refused before
a reader trusts its offsets. Standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

from ...errors import FileUnreadable
from ...findings import Finding, finding, json_path
from ...format.dcp_models import DcpDocument
from ...format.dtypes import ITEMSIZE
from ..hashing import file_digest
from .checks import check_dcp
from .digest import element_digest
from .metadata import METADATA_NAME, BytesEntry, DcpMetadata, TensorEntry
from .records import read_record

_HINT_OTHER = "the document describes another save: describe this one again with `ckptspec generate DCP_DIR`"


def check_against_document(
    directory: Path, document: DcpDocument, verify_hashes: bool = True
) -> tuple[DcpMetadata, list[Finding]]:
    """The metadata of the DCP checkpoint in ``directory`` and every finding of it against ``document``."""
    meta, findings = check_dcp(directory)
    findings += list(other_save(directory, meta, document, verify_hashes))
    findings += list(files_differ(directory, document, verify_hashes))
    if verify_hashes:
        findings += list(chunk_digests(directory, document))
    return meta, findings


def _metadata_differs(directory: Path, meta: DcpMetadata, document: DcpDocument, verify: bool) -> str | None:
    if meta.size != document.metadata.size:
        return f".metadata holds {meta.size} bytes, the document's {document.metadata.size}"
    recorded = document.metadata.hash
    if verify and recorded is not None:
        got = file_digest(directory / METADATA_NAME, recorded.algorithm).digest
        if got != recorded.digest:
            return f".metadata's {recorded.algorithm} is {got[:12]}..., the document's {recorded.digest[:12]}..."
    return None


def other_save(directory: Path, meta: DcpMetadata, document: DcpDocument, verify: bool) -> Iterator[Finding]:
    """CK255: the document's entries, chunks and items are ``.metadata``'s, its elements where the records put them."""
    differs = _metadata_differs(directory, meta, document, verify)
    if differs:
        yield finding("CK255", json_path("metadata"), differs, _HINT_OTHER, file=METADATA_NAME)
    items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    tensors = {fqn: e for fqn, e in meta.entries.items() if isinstance(e, TensorEntry)}
    described = {t.name for t in document.tensors}
    for t, tensor in enumerate(document.tensors):
        entry = tensors.get(tensor.name)
        if entry is None:
            yield finding("CK255", json_path("tensors", t), f"{tensor.name} is no tensor of .metadata", _HINT_OTHER)
            continue
        if (entry.dtype, list(entry.size)) != (tensor.dtype, tensor.shape):
            saved_as = f"{entry.dtype} {list(entry.size)}"
            msg = f"{tensor.name}: .metadata has {saved_as}, the document {tensor.dtype} {tensor.shape}"
            yield finding("CK255", json_path("tensors", t), msg, _HINT_OTHER)
            continue
        found = _chunks_differ(t, tensor, entry, items)
        if found is not None:
            yield found
    for fqn in tensors.keys() - described:
        yield finding("CK255", json_path("tensors"), f".metadata's tensor {fqn} is not in the document", _HINT_OTHER)
    yield from _bytes_items(meta, document)
    yield from _data_offsets(directory, document)


def _chunks_differ(t: int, tensor, entry: TensorEntry, items: dict) -> Finding | None:
    """One finding for a tensor whose chunks or storage items are not .metadata's, naming the first that differs."""
    saved = {c.offsets: c.sizes for c in entry.chunks}
    differ = []
    for c, chunk in enumerate(tensor.chunks):
        key = tuple(chunk.offsets)
        item = items.get((tensor.name, key))
        where = (chunk.file, chunk.offset, chunk.length)
        if saved.get(key) != tuple(chunk.sizes) or item is None or (item.file, item.offset, item.length) != where:
            at = "no such chunk" if item is None else f"{list(saved.get(key, ()))} in {item.file} at {item.offset}"
            differ.append((c, chunk, at))
    counts = f"{len(differ)} of the document's {len(tensor.chunks)} chunks are not .metadata's {len(saved)}"
    if not differ:
        if len(saved) == len(tensor.chunks):
            return None
        return finding("CK255", json_path("tensors", t, "chunks"), f"{tensor.name}: {counts}", _HINT_OTHER)
    c, chunk, at = differ[0]
    msg = (
        f"{tensor.name}: {counts}; the chunk at {chunk.offsets} is {list(chunk.sizes)} in {chunk.file} at "
        f"{chunk.offset} ({chunk.length} bytes), .metadata's {at}"
    )
    return finding("CK255", json_path("tensors", t, "chunks", c), msg, _HINT_OTHER, file=chunk.file)


def _bytes_items(meta: DcpMetadata, document: DcpDocument) -> Iterator[Finding]:
    saved = {
        i.fqn: (i.file, i.offset, i.length)
        for i in meta.items
        if i.chunk_offset is None and isinstance(meta.entries.get(i.fqn), BytesEntry)
    }
    listed = {b.name: (b.file, b.offset, b.length) for b in document.bytes}
    for b, item in enumerate(document.bytes):
        if saved.get(item.name) != listed[item.name]:
            msg = f"bytes item {item.name}: the document's {listed[item.name]}, .metadata's {saved.get(item.name)}"
            yield finding("CK255", json_path("bytes", b), msg, _HINT_OTHER, file=item.file)
    for name in saved.keys() - listed.keys():
        yield finding("CK255", json_path("bytes"), f".metadata's bytes item {name} is not in the document", _HINT_OTHER)


def _chunks_by_file(document: DcpDocument) -> dict[str, list[tuple[int, int]]]:
    """(tensor, chunk) indices of every chunk, by its file, in the document's order."""
    out: dict[str, list[tuple[int, int]]] = {}
    for t, tensor in enumerate(document.tensors):
        for c, chunk in enumerate(tensor.chunks):
            out.setdefault(chunk.file, []).append((t, c))
    return out


def _data_offsets(directory: Path, document: DcpDocument) -> Iterator[Finding]:
    """Each chunk's elements start where its record (read by the restricted reader) puts them."""
    sizes = _sizes(directory, document)
    for name, chunks in _chunks_by_file(document).items():
        size = sizes.get(name)
        if size is None:
            continue  # CK252's, CK256's
        try:
            with open(directory / name, "rb") as fh:
                for t, c in chunks:
                    tensor, chunk = document.tensors[t], document.tensors[t].chunks[c]
                    if chunk.offset + chunk.length > size:
                        continue  # CK253's
                    try:
                        record = read_record(fh, directory / name, chunk.offset, chunk.length)
                    except ValueError:
                        continue  # CK254's
                    if record.data_offset != chunk.data_offset:
                        msg = (
                            f"{tensor.name}: the chunk's elements start at byte {record.data_offset}, "
                            f"not {chunk.data_offset}"
                        )
                        where = json_path("tensors", t, "chunks", c, "data_offset")
                        yield finding("CK255", where, msg, _HINT_OTHER, file=name)
        except OSError as exc:
            raise FileUnreadable(directory / name, exc) from None


def _sizes(directory: Path, document: DcpDocument) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for f in document.files:
        try:
            out[f.path] = os.stat(directory / f.path).st_size
        except FileNotFoundError:
            out[f.path] = None
        except OSError as exc:
            raise FileUnreadable(directory / f.path, exc) from None
    return out


def files_differ(directory: Path, document: DcpDocument, verify: bool) -> Iterator[Finding]:
    """CK256: every listed file has the document's size (and hash, when recorded and ``verify``)."""
    hint = "the file is not the one the document describes (another save's, cut short, rewritten): restore it"
    sizes = _sizes(directory, document)
    for i, f in enumerate(document.files):
        size = sizes[f.path]
        if size is None:
            yield finding("CK256", json_path("files", i), f"{f.path} is missing", hint, file=f.path)
        elif size != f.size:
            yield finding(
                "CK256", json_path("files", i, "size"), f"holds {size} bytes, not {f.size}", hint, file=f.path
            )
        elif verify and f.hash is not None:
            got = file_digest(directory / f.path, f.hash.algorithm).digest
            if got != f.hash.digest:
                msg = f"its {f.hash.algorithm} is {got[:12]}..., not {f.hash.digest[:12]}..."
                yield finding("CK256", json_path("files", i, "hash"), msg, hint, file=f.path)


def chunk_digests(directory: Path, document: DcpDocument) -> Iterator[Finding]:
    """CK257: each chunk's recorded digest is the sha256 of its elements (files of the document's size only); one
    finding per file, naming the first chunks that differ."""
    hint = "the chunk's bytes changed since the document was made (same layout, other values): restore the file"
    sizes = _sizes(directory, document)
    listed = {f.path: f.size for f in document.files}
    for name, chunks in _chunks_by_file(document).items():
        if sizes.get(name) is None or sizes.get(name) != listed.get(name):
            continue  # CK256's
        hashed = [(t, c) for t, c in chunks if document.tensors[t].chunks[c].digest is not None]
        bad = []
        try:
            with open(directory / name, "rb") as fh:
                for t, c in hashed:
                    tensor, chunk = document.tensors[t], document.tensors[t].chunks[c]
                    nbytes = ITEMSIZE[tensor.dtype] * math.prod(chunk.sizes)
                    if element_digest(fh, chunk.data_offset, nbytes) != chunk.digest.sha256:
                        bad.append((t, c))
        except OSError as exc:
            raise FileUnreadable(directory / name, exc) from None
        if bad:
            t, c = bad[0]
            named = ", ".join(
                f"{document.tensors[t].name} at {document.tensors[t].chunks[c].offsets}" for t, c in bad[:3]
            )
            msg = f"{len(bad)} of its {len(hashed)} hashed chunks hold other bytes: {named}"
            yield finding("CK257", json_path("tensors", t, "chunks", c, "digest"), msg, hint, file=name)
