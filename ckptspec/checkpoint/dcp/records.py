"""A DCP tensor item's bytes: the ``torch.save`` record of one chunk, read in place without unpickling it unsafely.

``FileSystemWriter`` writes each tensor chunk as a whole ``torch.save`` zip at ``offset`` of its ``.distcp``
(``length`` bytes). ``read_record`` opens that zip through a window on the file (only its directory, its
``data.pkl`` and one local header are read), decodes ``data.pkl`` with the restricted ``.pt`` reader
(``torchfile``) and locates the tensor's bytes in the file: what a reconstruction reads, and what a check
compares with the chunk the metadata promises. ``read_value`` decodes a bytes item the same way (an optimizer
hyperparameter, ``torch.save``d by DCP's planner) and gives it only when it is a plain value. Standard library only.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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


PLAIN = (bool, int, float, str, type(None))  # what a hyperparameter may be (tuples and lists of them too)


def read_value(fh: BinaryIO, path: Path, offset: int, length: int) -> Any:
    """The plain value (``PLAIN``, or a tuple or list of them) a bytes item at ``offset`` of ``fh`` holds, decoded by
    the restricted reader; ``ValueError`` names anything else (a tensor, a class instance: never built)."""
    with _opened(fh, offset, length) as (zf, infos, prefix):
        value = _decoded(zf, infos, prefix, path)
    items = value if type(value) in (tuple, list) else (value,)
    if not all(type(v) in PLAIN for v in items):
        raise ValueError(f"the item holds a {type(value).__name__}, not a plain value")
    return value


@contextlib.contextmanager
def _opened(fh: BinaryIO, offset: int, length: int):
    """The ``torch.save`` zip of ``length`` bytes at ``offset``: (zip, its members by name, its prefix)."""
    try:
        zf = zipfile.ZipFile(_Window(fh, offset, length))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"no torch.save record ({exc})") from None
    with zf:
        infos = {info.filename: info for info in zf.infolist()}
        names = list(infos)
        yield zf, infos, names[0].split("/", 1)[0] if names and "/" in names[0] else ""


def _decoded(zf: zipfile.ZipFile, infos: dict, prefix: str, path: Path) -> Any:
    """The record's ``data.pkl``, decoded by the restricted reader (refused or damaged: ``ValueError``, never run)."""
    pkl = infos.get(f"{prefix}/data.pkl")
    if pkl is None or pkl.file_size > MAX_RECORD_PICKLE or pkl.compress_type != zipfile.ZIP_STORED:
        raise ValueError("no stored data.pkl of one tensor in the record")
    try:
        data = zf.read(pkl)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"the record's data.pkl is unreadable ({exc})") from None
    raw = RawPickle(path, data, prefix, {n: i.file_size for n, i in infos.items()})
    try:
        return decode_data_pkl(raw)
    except Exception as exc:  # TorchFileError: refused or damaged, never run
        raise ValueError(f"the record's data.pkl: {getattr(exc, 'reason', exc)}") from None


def read_record(fh: BinaryIO, path: Path, offset: int, length: int) -> Record:
    """The record of the item at ``offset`` (``length`` bytes) of the open ``.distcp`` ``fh``; ``ValueError`` says
    why it is not one tensor's ``torch.save`` record inside those bytes."""
    window = _Window(fh, offset, length)
    with _opened(fh, offset, length) as (zf, infos, prefix):
        tensor = _decoded(zf, infos, prefix, path)
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
