"""A DCP tensor's digest: sha256 of its whole row-major bytes, read from its chunks' records run by run in the
whole tensor's order (the chunks cover it exactly once, CK250), a MiB at a time: flat memory whatever its size.
Two saves of one tensor under any sharding have the same digest when their elements are the same bytes.
Standard library only."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ...errors import FileUnreadable
from ...format.dtypes import ITEMSIZE
from ...location import RemotePath, open_binary
from .metadata import DcpMetadata, TensorEntry
from .records import read_record
from .runs import runs

_PIECE = 1 << 20


def tensor_digest(directory: Path | RemotePath, meta: DcpMetadata, fqn: str) -> str:
    """``sha256:<hex>`` of the tensor entry ``fqn`` of the checked checkpoint in ``directory`` (local or a URL)."""
    entry = meta.entries[fqn]
    assert isinstance(entry, TensorEntry)
    itemsize = ITEMSIZE[entry.dtype]
    items = {(i.fqn, i.chunk_offset): i for i in meta.items}
    h = hashlib.sha256()
    handles: dict = {}
    try:
        placed: list[
            tuple[int, str, int, int]
        ] = []  # (element offset in the whole tensor, file, byte offset, elements)
        for chunk in entry.chunks:
            item = items[(fqn, chunk.offsets)]
            fh = handles.get(item.file)
            if fh is None:
                fh = handles[item.file] = open_binary(directory / item.file)  # closed below
            record = read_record(fh, directory / item.file, item.offset, item.length)
            placed.extend(
                (dst, item.file, record.data_offset + src * itemsize, n) for src, dst, n in runs(entry.size, chunk)
            )
        for _, name, start, n in sorted(placed):
            try:
                hash_range(h, handles[name], start, n * itemsize)
            except OSError as exc:
                raise FileUnreadable(directory / name, exc) from None
    except OSError as exc:
        raise FileUnreadable(directory, exc) from None
    finally:
        for fh in handles.values():
            fh.close()
    return f"sha256:{h.hexdigest()}"


def hash_range(h, fh, start: int, nbytes: int) -> None:
    """Feed ``nbytes`` bytes at ``start`` of the open file to the hash ``h``, a MiB at a time; ``OSError`` when the
    file ends first."""
    fh.seek(start)
    left = nbytes
    while left:
        data = fh.read(min(left, _PIECE))
        if not data:
            raise OSError("the file ends inside a chunk (it changed while read)")
        h.update(data)
        left -= len(data)


def element_digest(fh, start: int, nbytes: int) -> str:
    """sha256 (hex) of ``nbytes`` bytes at ``start`` of the open file."""
    h = hashlib.sha256()
    hash_range(h, fh, start, nbytes)
    return h.hexdigest()
