"""torch's zip container (``torch.save``'s file format) written record by record, each record's bytes
from an iterable of chunks: a record larger than memory (a model's flat weight buffer, a partition of
the masters) is written without ever being whole in memory.

The bytes are those ``torch._C.PyTorchFileWriter`` (torch 2.x, its miniz) writes, so a file written
here equals ``torch.save``'s for the same pickle and storages (checked by ``tests/export/test_torch_zip.py``
against ``torch.save`` itself): records stored uncompressed under ``<archive>/`` (the file's name
without its extension), each local header followed by an ``FB`` extra field padding the data to a
64-byte boundary, then the data, then a data descriptor (CRC-32 and sizes; 64-bit sizes and a zip64
extra field once a size or offset reaches 4 GiB); a ``version`` record and ``.data/serialization_id``
last, then the central directory and the zip64 end records miniz always writes.

The serialization id is 20 digits of a hash of the record names (an ``unordered_set`` walk, which
only torch can reproduce) and 20 digits of the records' CRC-32s combined in write order (c10's
``hash_combine``): the former, and the ``version`` record, are taken from torch's own writer run on
the same record names with no data (``ds_pickle.torch_trailer``; this module needs no torch).

Writing into any binary ``sink`` instead of a file gives the bytes (and, with records of unknown
content, the size) of a file torch would have written: ``before_embed`` rebuilds a model-states file
as it was before ``ckptspec embed`` added its manifest, to compare it with a manifest's record.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

ALIGNMENT = 64
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names
_EMPTY_FLAGS = 0x0800
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")


def archive_name(path: Path) -> str:
    """torch's archive prefix: the file's name without its last extension."""
    name = Path(path).name
    return name[: name.rindex(".")] if "." in name else name


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def _zip64_extra(size: int | None, offset: int | None, compressed: int | None = None) -> bytes:
    """miniz's zip64 extra field; the local header's holds a compressed size of 0 (not known yet)."""
    fields = b""
    if size is not None:
        fields += struct.pack("<QQ", size, size if compressed is None else compressed)
    if offset is not None:
        fields += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


class TorchZipWriter:
    """``write_record`` per record, then ``close``; a file torch.load reads as torch.save wrote it.

    ``sink``: write there (any object with ``write``) instead of creating ``path``; ``archive``:
    the records' prefix, when it is not ``path``'s own (a file saved under another name)."""

    def __init__(self, path: Path, *, sink=None, archive: str | None = None):
        self.path = Path(path)
        self.prefix = (archive if archive is not None else archive_name(self.path)) + "/"
        self._owned = sink is None  # a file of its own: closed by close(), finish() or abort()
        self._file = open(self.path, "wb") if sink is None else sink
        self._pos = 0
        self._names: list[str] = []
        self._central: list[bytes] = []
        self._crc_seed = 0

    @property
    def written(self) -> int:
        """Bytes written so far (measured ones included)."""
        return self._pos

    def _write(self, data) -> None:
        self._file.write(data)
        self._pos += len(memoryview(data).cast("B"))

    def write_record(
        self, name: str, chunks: Iterable[bytes | bytearray | memoryview] | bytes | None, size: int
    ) -> None:
        """Record ``name`` of ``size`` bytes, the concatenation of ``chunks`` (bytes-like). ``chunks``
        None: only measuring (the sink discards what it gets); the data and its CRC are not written."""
        parts = [chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks
        full = (self.prefix + name).encode("utf-8")
        offset = self._pos
        big_size, big_offset = size >= _U32, offset >= _U32
        extra64 = _zip64_extra(size if big_size else None, offset if big_offset else None, 0)
        start = offset + _LOCAL.size + len(full) + len(extra64) + 4
        pad = (-start) % ALIGNMENT
        extra = extra64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        # miniz writes no data descriptor for an empty record, nor its flag
        flags = _FLAGS if size else _EMPTY_FLAGS
        self._write(_LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)))
        self._write(full)
        self._write(extra)
        crc, written = 0, 0
        if chunks is None:  # measuring only
            written = size
            self._pos += size
        for chunk in parts or ():
            view = memoryview(chunk).cast("B")
            crc = zlib.crc32(view, crc)
            written += len(view)
            self._write(view)
        if written != size:
            raise ValueError(f"record {name}: {written} bytes written, {size} announced")
        if extra64:
            self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        elif size:
            self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        if size:  # torch combines the CRC-32s of the data descriptors it sees written
            self._crc_seed = _hash_combine(self._crc_seed, crc)
        self._names.append(name)
        central_extra = _zip64_extra(size if big_size else None, offset if big_offset else None)
        self._central.append(
            _CENTRAL.pack(
                0x02014B50,
                0,
                0,
                flags,
                0,
                0,
                0,
                crc,
                min(size, _U32),
                min(size, _U32),
                len(full),
                len(central_extra),
                0,
                0,
                0,
                0,
                min(offset, _U32),
            )  # fmt: skip
            + full
            + central_extra
        )

    def close(self, trailer) -> None:
        """torch's closing records (``version``, ``.data/serialization_id``), the directory, the end records.
        ``trailer(names)``: the name half of the serialization id and the ``version`` record, from torch
        (``ds_pickle.torch_trailer``: torch is imported there only)."""
        names_hash, version = trailer(self._names)
        self.write_record("version", version, len(version))
        serial = f"{names_hash}{self._crc_seed:020d}".encode()
        self.write_record(".data/serialization_id", serial, len(serial))
        self.finish()

    def finish(self) -> None:
        """The directory and the end records after the records written so far (a file whose closing
        records are copied from another, like any record), then the file is closed."""
        directory = b"".join(self._central)
        offset = self._pos
        self._write(directory)
        end64 = self._pos
        count = len(self._central)
        size = len(directory)
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, count, count, size, offset))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end64, 1))
        self._write(
            struct.pack(
                "<IHHHHIIH",
                0x06054B50,
                0,
                0,
                min(count, 0xFFFF),
                min(count, 0xFFFF),
                min(len(directory), _U32),
                min(offset, _U32),
                0,
            )  # fmt: skip
        )
        self.abort()

    def abort(self) -> None:
        if self._owned:
            self._file.close()
