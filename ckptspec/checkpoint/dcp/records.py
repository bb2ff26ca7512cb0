"""A DCP tensor item's bytes: the ``torch.save`` record of one chunk, read in place without unpickling it unsafely.

``FileSystemWriter`` writes each tensor chunk as a whole ``torch.save`` zip at ``offset`` of its ``.distcp``
(``length`` bytes). ``read_record`` opens that zip through a window on the file (only its directory, its
``data.pkl`` and one local header are read), decodes ``data.pkl`` with the restricted ``.pt`` reader
(``torchfile``) and locates the tensor's bytes in the file: what a reconstruction reads, and what a check
compares with the chunk the metadata promises. Standard library only.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...location import RemotePath
from ..standins import TensorRef
from ..torchfile import RawPickle, decode_data_pkl

MAX_RECORD_PICKLE = 1 << 20  # one tensor's data.pkl: ~150 bytes
_LOCAL = struct.Struct("<4s22xHH")  # signature, then the name and extra field lengths


@dataclass(frozen=True)
class Record:
    """The tensor a record holds and where its bytes are in the ``.distcp`` file (absolute offset)."""

    dtype: str
    shape: tuple[int, ...]
    contiguous: bool
    data_offset: int
    nbytes: int  # of the tensor's elements (its view of the storage)


class _Window(io.RawIOBase):
    """``length`` bytes at ``start`` of an open file, as a file of their own (what ``zipfile`` reads)."""

    def __init__(self, fh: BinaryIO, start: int, length: int):
        super().__init__()
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._length - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _data_pkl(zf: zipfile.ZipFile) -> tuple[bytes, str, dict[str, zipfile.ZipInfo]]:
    """The record's ``data.pkl`` (stored, at most ``MAX_RECORD_PICKLE`` bytes), its archive prefix, its members."""
    infos = {info.filename: info for info in zf.infolist()}
    names = list(infos)
    prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else ""
    pkl = infos.get(f"{prefix}/data.pkl")
    if pkl is None or pkl.file_size > MAX_RECORD_PICKLE or pkl.compress_type != zipfile.ZIP_STORED:
        raise ValueError("no stored data.pkl of one value in the record")
    try:
        return zf.read(pkl), prefix, infos
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"the record's data.pkl is unreadable ({exc})") from None


def _open(fh: BinaryIO, offset: int, length: int) -> tuple[zipfile.ZipFile, _Window]:
    window = _Window(fh, offset, length)
    try:
        return zipfile.ZipFile(window), window
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"no torch.save record ({exc})") from None


def read_value_pickle(fh: BinaryIO, offset: int, length: int) -> bytes:
    """The ``data.pkl`` of a bytes item's record (``torch.save`` of any object), unread as a pickle: what
    ``values.plain_value`` reads; ``ValueError`` says why the bytes hold no record."""
    zf, _ = _open(fh, offset, length)
    with zf:
        return _data_pkl(zf)[0]


def read_record(fh: BinaryIO, path: Path | RemotePath, offset: int, length: int) -> Record:
    """The record of the item at ``offset`` (``length`` bytes) of the open ``.distcp`` ``fh``; ``ValueError`` says
    why it is not one tensor's ``torch.save`` record inside those bytes."""
    zf, window = _open(fh, offset, length)
    with zf:
        data, prefix, infos = _data_pkl(zf)
        raw = RawPickle(path, data, prefix, {n: i.file_size for n, i in infos.items()})
        try:
            tensor = decode_data_pkl(raw)
        except Exception as exc:  # TorchFileError: refused or damaged, never run
            raise ValueError(f"the record's data.pkl: {getattr(exc, 'reason', exc)}") from None
        if type(tensor) is not TensorRef:
            raise ValueError(f"the record holds a {type(tensor).__name__}, not a tensor")
        member = infos[tensor.storage.member]
        if member.compress_type != zipfile.ZIP_STORED:
            raise ValueError("the tensor's storage is compressed")
        window.seek(member.header_offset)
        sig, name_len, extra_len = _LOCAL.unpack(window.read(_LOCAL.size).ljust(_LOCAL.size, b"\0"))
        if sig != b"PK\x03\x04":
            raise ValueError("the storage's local header is not where the directory says")
    start = member.header_offset + _LOCAL.size + name_len + extra_len
    begin = start + tensor.storage_offset * tensor.storage.itemsize
    nbytes = tensor.numel * tensor.storage.itemsize
    if start + member.file_size > length or begin + nbytes > start + member.file_size:
        raise ValueError("the tensor's bytes run past the record")
    return Record(tensor.dtype, tuple(tensor.shape), tensor.is_contiguous(), offset + begin, nbytes)
