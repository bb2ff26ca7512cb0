"""The checks of a torch DCP checkpoint's files against its ``.metadata`` (CK250-CK254): one rule, one function.

``check_dcp(directory)`` reads ``.metadata`` (``metadata.read_metadata``: refused unread or unrun, CK204, CK205,
CK225, raised) and runs every check, each reporting all it finds:

- CK250 every tensor's chunks cover it exactly once: inside its size, no two overlapping, as many elements as it has;
- CK251 every chunk and bytes entry has a storage item, and every item names one;
- CK252 every file an item names is in the directory;
- CK253 every item lies inside its file (offset + length <= the file's size);
- CK254 every tensor item's bytes are a ``torch.save`` record of its chunk: its dtype and sizes (``records``), and
  every bytes item's a record of a value (an undamaged pickle);
- CK204 every bytes item's pickle is of a plain value: it names no global but ``torch.Size`` and dtypes (``values``);
- CK252 a Megatron-core torch_dist save (``metadata.json`` beside ``.metadata``) has its ``common.pt``.

A Megatron save's ``metadata.json`` and ``common.pt`` are read first (``megatron.read_megatron``: ``common.pt`` by the
restricted reader, a global off its list refused by name, CK204, raised like a forged ``.metadata``).

Bytes entries (``BytesStorage``: a ``torch.save`` of any object, which ``dcp.load`` unpickles unrestricted) are read
by ``bytes_values`` through the restricted reader only: a global off its list is refused by name, never called.
Standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ...errors import FileUnreadable, UnsafePickleError
from ...findings import Finding, finding
from ...location import RemotePath, open_binary
from .megatron import COMMON_NAME, is_megatron_dir, read_megatron
from .metadata import BytesEntry, DcpMetadata, Item, TensorEntry, read_metadata
from .records import read_record, read_value_pickle
from .values import plain_value

Where = Path | RemotePath  # a DCP directory: local, or at a URL (read in ranges through ``location``)
Check = Callable[[Where, DcpMetadata], list[Finding]]


def check_dcp(directory: Where) -> tuple[DcpMetadata, list[Finding]]:
    """The metadata of the DCP checkpoint in ``directory`` and every finding of its checks."""
    meta = read_metadata(directory)
    if is_megatron_dir(directory):
        meta = replace(meta, megatron=read_megatron(directory))
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(directory, meta))
    return meta, findings


def bytes_entries(meta: DcpMetadata) -> list[str]:
    """The bytes entries: pickles of Python objects, which ckptspec lists and never unpickles."""
    return [fqn for fqn, entry in meta.entries.items() if isinstance(entry, BytesEntry)]


def bytes_values(directory: Where, meta: DcpMetadata) -> dict[str, object]:
    """Each bytes item's value (plain: ``values.plain_value``) or, for one that is not, the exception saying why
    (``UnsafePickleError``: a global off the list; ``ValueError``: no record, a damaged pickle). Items of missing
    files or past their file's end are left out (CK252's, CK253's)."""
    sizes = _sizes(directory, meta)
    out: dict[str, object] = {}
    for name, items in _by_file(meta).items():
        size = sizes.get(name)
        wanted = [i for i in items if isinstance(meta.entries.get(i.fqn), BytesEntry) and i.chunk_offset is None]
        wanted = [i for i in wanted if size is not None and i.offset + i.length <= size]
        if not wanted:
            continue
        try:
            with open_binary(directory / name) as fh:
                for item in wanted:
                    try:
                        out[item.fqn] = plain_value(
                            read_value_pickle(fh, item.offset, item.length), directory / name, item.fqn
                        )
                    except (UnsafePickleError, ValueError) as exc:
                        out[item.fqn] = exc
        except OSError as exc:
            raise FileUnreadable(directory / name, exc) from None
    return out


def _tensors(meta: DcpMetadata) -> dict[str, TensorEntry]:
    return {fqn: e for fqn, e in meta.entries.items() if isinstance(e, TensorEntry)}


def _overlap(a, b) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def chunk_coverage(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK250: a tensor's chunks lie inside it, do not overlap, and together hold all of its elements."""
    out = []
    for fqn, entry in _tensors(meta).items():
        where = f"$.state_dict_metadata[{fqn!r}]"
        outside = [c for c in entry.chunks if any(o + s > w for o, s, w in zip(c.offsets, c.sizes, entry.size))]
        for c in outside:
            out.append(
                _ck250(
                    where, f"{fqn}: chunk at {list(c.offsets)} of sizes {list(c.sizes)} lies outside {list(entry.size)}"
                )
            )
        chunks = sorted((c for c in entry.chunks if c not in outside), key=lambda c: c.offsets)
        overlaps = _overlapping(chunks)
        for a, b in overlaps[:4]:
            out.append(_ck250(where, f"{fqn}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap"))
        held, whole = sum(c.numel for c in chunks), math.prod(entry.size)
        if not outside and not overlaps and held != whole:
            out.append(_ck250(where, f"{fqn}: its chunks hold {held} of its {whole} elements (a gap)"))
    return out


def _overlapping(chunks: list) -> list[tuple]:
    """Pairs of non-empty chunks that overlap, ``chunks`` sorted by offsets: each is compared with the chunks that
    start before it ends on the first dimension only (a world size of FSDP2's dim-0 shards: its neighbour)."""
    out = []
    for i, a in enumerate(chunks):
        if not a.numel:
            continue
        for b in chunks[i + 1 :]:
            if a.offsets and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if b.numel and _overlap(a, b):
                out.append((a, b))
    return out


def _ck250(where: str, message: str) -> Finding:
    hint = "the .metadata is not the one this save wrote (forged or edited): restore it from the save"
    return finding("CK250", where, message, hint)


def _item_key(item: Item) -> tuple:
    return item.fqn, item.chunk_offset


def storage_items(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK251: each chunk and bytes entry has one storage item; each item is one's."""
    hint = "the .metadata's storage_data does not match its state_dict_metadata: restore the .metadata"
    items = {_item_key(i) for i in meta.items}
    wanted = set()
    out = []
    for fqn, entry in meta.entries.items():
        keys = [(fqn, c.offsets) for c in entry.chunks] if isinstance(entry, TensorEntry) else [(fqn, None)]
        for key in keys:
            wanted.add(key)
            if key not in items:
                at = "" if key[1] is None else f" (chunk at {list(key[1])})"
                out.append(finding("CK251", f"$.state_dict_metadata[{fqn!r}]", f"{fqn}{at} has no storage item", hint))
    for item in meta.items:
        if _item_key(item) not in wanted:
            msg = f"storage item {item.fqn} at {item.chunk_offset} is no chunk of a saved entry"
            out.append(finding("CK251", "$.storage_data", msg, hint, file=item.file))
    return out


def _by_file(meta: DcpMetadata) -> dict[str, list[Item]]:
    """The items of each file, in the metadata's order."""
    out: dict[str, list[Item]] = {}
    for item in meta.items:
        out.setdefault(item.file, []).append(item)
    return out


def _sizes(directory: Where, meta: DcpMetadata) -> dict[str, int | None]:
    """Each named file's size (None: absent)."""
    out: dict[str, int | None] = {}
    for name in meta.files:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            out[name] = None  # DCP names files in its directory; anything else is not read
            continue
        out[name] = _size(directory / name)
    return out


def _size(path: Where) -> int | None:
    """A file's size, None when it is not there (a URL: its directory's listing says, a request at most)."""
    if isinstance(path, RemotePath):
        return path.stat().st_size if path.is_file() else None
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileUnreadable(path, exc) from None


def files_bytes(directory: Where, meta: DcpMetadata) -> int:
    """The bytes of the checkpoint's files: ``.metadata`` and each named file that is there."""
    return meta.size + sum(size for size in _sizes(directory, meta).values() if size is not None)


def files_present(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK252: every file the items name is in the directory (a name, never a path)."""
    hint = "restore the file from the save; without it the chunks it held are lost"
    out = []
    for name, size in _sizes(directory, meta).items():
        if size is None:
            count = len(_by_file(meta)[name])
            out.append(finding("CK252", "$.storage_data", f"{name} is missing ({count} items in it)", hint, file=name))
    return out


def items_inside_files(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK253: every item ends inside its file."""
    hint = "the file is cut short (an interrupted copy or save): restore it"
    sizes = _sizes(directory, meta)
    out = []
    for name, size in sizes.items():
        if size is None:
            continue
        past = [i for i in _by_file(meta)[name] if i.offset + i.length > size]
        if past:
            end = max(i.offset + i.length for i in past)
            msg = f"{len(past)} items end past its {size} bytes (the last at byte {end}): first {past[0].fqn}"
            out.append(finding("CK253", "$.storage_data", msg, hint, file=name))
    return out


def item_records(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK254: each tensor item (in a present file, inside it) is a torch.save record of its chunk."""
    hint = "the file's bytes are not this save's (another save's file, swapped, overwritten): restore it"
    sizes = _sizes(directory, meta)
    tensors = _tensors(meta)
    chunks = {(fqn, c.offsets): c for fqn, e in tensors.items() for c in e.chunks}
    out = []
    for name, size in sizes.items():
        if size is None:
            continue
        items = [i for i in _by_file(meta)[name] if i.offset + i.length <= size and i.fqn in tensors]
        bad = []
        try:
            with open_binary(directory / name) as fh:
                for item in items:
                    chunk = chunks.get(_item_key(item))
                    if chunk is None:
                        continue  # CK251's
                    try:
                        record = read_record(fh, directory / name, item.offset, item.length)
                    except ValueError as exc:
                        bad.append(f"{item.fqn} at byte {item.offset}: {exc}")
                        continue
                    dtype = tensors[item.fqn].dtype
                    if (record.dtype, record.shape) != (dtype, chunk.sizes) or not record.contiguous:
                        got = f"{record.dtype} {list(record.shape)}" + ("" if record.contiguous else " (strided)")
                        bad.append(f"{item.fqn} at byte {item.offset}: holds {got}, not {dtype} {list(chunk.sizes)}")
        except OSError as exc:
            raise FileUnreadable(directory / name, exc) from None
        if bad:
            msg = f"{len(bad)} of its {len(items)} tensor items are not their chunk's record: " + "; ".join(bad[:3])
            out.append(finding("CK254", "$.storage_data", msg, hint, file=name))
    return out


def bytes_records(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK254: each bytes item (in a present file, inside it) is a ``torch.save`` record of a value."""
    hint = "the file's bytes are not this save's (another save's file, swapped, overwritten): restore it"
    files = {i.fqn: i.file for i in meta.items if i.chunk_offset is None}
    out: dict[str, list[str]] = {}
    for fqn, value in bytes_values(directory, meta).items():
        if type(value) is ValueError:
            out.setdefault(files[fqn], []).append(f"{fqn}: {value}")
    return [
        finding(
            "CK254",
            "$.storage_data",
            f"{len(bad)} bytes items are no value's record: " + "; ".join(bad[:3]),
            hint,
            file=name,
        )
        for name, bad in out.items()
    ]


def bytes_plain(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK204: each bytes item's pickle is of a plain value, naming no global off ``values.ALLOWED``: ``dcp.load``
    would unpickle it unrestricted and call what it names."""
    hint = "the item's pickle would run code when torch loads it (a forged checkpoint): do not load it with dcp.load"
    files = {i.fqn: i.file for i in meta.items if i.chunk_offset is None}
    return [
        finding("CK204", f"$.state_dict_metadata[{fqn!r}]", value.reason, hint, file=files[fqn])
        for fqn, value in bytes_values(directory, meta).items()
        if isinstance(value, UnsafePickleError)
    ]


def megatron_common(directory: Where, meta: DcpMetadata) -> list[Finding]:
    """CK252: a Megatron-core save has its common.pt (rank 0 writes it; Megatron's load reads it first)."""
    if meta.megatron is None or meta.megatron.common is not None:
        return []
    hint = "restore common.pt from the save: it holds the state that is no sharded tensor (iteration, scheduler)"
    return [finding("CK252", "$", f"{COMMON_NAME} is missing (Megatron's common state)", hint, file=COMMON_NAME)]


CHECKS: list[Check] = [
    chunk_coverage,
    storage_items,
    files_present,
    items_inside_files,
    item_records,
    bytes_records,
    bytes_plain,
    megatron_common,
]
