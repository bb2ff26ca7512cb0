"""Write safetensors files tensor by tensor, in bounded memory, atomically.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian
header length N, N bytes of JSON header (``{"__metadata__": {str: str}, name:
{"dtype", "shape", "data_offsets": [begin, end]}}``, padded with spaces to a
multiple of 8), then the raw little-endian tensor bytes back to back, in the
order of their offsets. All shapes and dtypes are known before any data is
written, so the header goes first and each tensor's bytes are streamed after it:
nothing needs to be held in memory at once (``safetensors.*.save_file`` needs
every tensor in memory).

The file is written under a temporary name in the target directory (``tmp_path``); the
caller renames it once every file of its output is complete. Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .._fs import fsync, io_point, temp_file
from ..errors import SafetensorsWriteError
from ..format.dtypes import ITEMSIZE

# Manifest dtype name -> safetensors dtype code (safetensors 0.4+).
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
}
_COPY_CHUNK = 64 << 20  # bytes per copy_file_range call


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # manifest dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


def build_header(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the padded JSON header for ``entries`` in this order."""
    header: dict = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise SafetensorsWriteError(f"metadata must map strings to strings; bad keys {bad}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise SafetensorsWriteError(f"{entry.name}: dtype {entry.dtype} has no safetensors code")
        if entry.name in header or entry.name == "__metadata__":
            raise SafetensorsWriteError(f"duplicate tensor name {entry.name!r}")
        end = offset + entry.nbytes
        header[entry.name] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


class TensorSink(Protocol):
    """Where a tensor's bytes go, in order: a ``SafetensorsWriter`` (the tensor begun) or a ``Region`` of one."""

    def write(self, data) -> None: ...

    def copy_range(self, src_fd: int, offset: int, nbytes: int) -> None: ...


def copy_bytes(src_fd: int, offset: int, nbytes: int, dst_fd: int, dst_pos: int) -> int:
    """Copy ``nbytes`` of ``src_fd`` at ``offset`` to ``dst_fd`` at ``dst_pos``, in the kernel when possible
    (``copy_file_range``; both offsets explicit, so threads can copy into one file at once)."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < nbytes:
        io_point("write")
        count = min(_COPY_CHUNK, nbytes - done)
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, count, offset + done, dst_pos + done)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF):
                    use_kernel = False
                    continue
                raise
            if n == 0:
                raise SafetensorsWriteError(f"source ended {nbytes - done} bytes early at offset {offset + done}")
        else:
            chunk = os.pread(src_fd, min(count, 8 << 20), offset + done)
            if not chunk:
                raise SafetensorsWriteError(f"source ended {nbytes - done} bytes early at offset {offset + done}")
            n = os.pwrite(dst_fd, chunk, dst_pos + done)
        done += n
    return done


class Region:
    """The bytes of one tensor of a ``SafetensorsWriter``'s file, written at their own offsets (from
    one thread at a time): ``write`` and ``copy_range`` append within ``[start, end)``."""

    def __init__(self, fd: int, name: str, start: int, end: int):
        self._fd, self.name, self.pos, self.end = fd, name, start, end

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._check_room(len(view))
        while view:
            io_point("write")
            n = os.pwrite(self._fd, view, self.pos)
            self.pos += n
            view = view[n:]

    def copy_range(self, src_fd: int, offset: int, nbytes: int) -> None:
        self._check_room(nbytes)
        self.pos += copy_bytes(src_fd, offset, nbytes, self._fd, self.pos)

    def part(self, skip: int, nbytes: int) -> Region:
        """The ``nbytes`` after the first ``skip`` bytes of this region (a piece for another thread)."""
        if skip + nbytes > self.end - self.pos:
            raise SafetensorsWriteError(f"{self.name}: a part past the end of the tensor")
        return Region(self._fd, self.name, self.pos + skip, self.pos + skip + nbytes)

    def _check_room(self, nbytes: int) -> None:
        if self.pos + nbytes > self.end:
            raise SafetensorsWriteError(f"{self.name}: {self.pos + nbytes - self.end} bytes too many")


class SafetensorsWriter:
    """Stream one safetensors file: ``begin(name)``, then ``write``/``copy_range`` its bytes.

    Tensors must be written in the order given. ``finish()`` checks every byte was
    written, fsyncs and closes ``tmp_path``; ``abort()`` removes it.
    """

    def __init__(
        self, path: str | os.PathLike, entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None = None
    ):
        self.path = Path(path)
        self.entries = list(entries)
        header = build_header(self.entries, metadata)
        self.data_start = len(header)
        self.nbytes = self.data_start + sum(e.nbytes for e in self.entries)
        fd, self.tmp_path = temp_file(self.path)
        self._fd: int | None = fd
        self._pos = 0
        self._index = -1  # entry being written
        self._entry_end = self.data_start
        try:
            self._write_all(header)
        except BaseException:
            self.abort()
            raise

    # -- writing ---------------------------------------------------------------------------

    def begin(self, name: str) -> TensorEntry:
        """Start the next tensor; the previous one must be complete."""
        if self._pos != self._entry_end:
            current = self.entries[self._index].name
            raise SafetensorsWriteError(f"{current}: {self._entry_end - self._pos} bytes missing")
        self._index += 1
        if self._index >= len(self.entries) or self.entries[self._index].name != name:
            expected = self.entries[self._index].name if self._index < len(self.entries) else None
            raise SafetensorsWriteError(f"tensor {name!r} written out of order (expected {expected!r})")
        entry = self.entries[self._index]
        self._entry_end = self._pos + entry.nbytes
        return entry

    def write(self, data) -> None:
        """Append bytes (any buffer: bytes, memoryview, contiguous numpy array) to the current tensor."""
        view = memoryview(data).cast("B")
        self._check_room(len(view))
        self._write_all(view)

    def copy_range(self, src_fd: int, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` read from ``src_fd`` at ``offset``, in the kernel when possible."""
        self._check_room(nbytes)
        self._pos += copy_bytes(src_fd, offset, nbytes, self._open_fd(), self._pos)

    # -- writing in parallel -----------------------------------------------------------------

    def regions(self) -> list[Region]:
        """One ``Region`` per tensor, each writing at its own place in the file, for threads that
        fill the tensors in any order; ``regions_done`` then stands for the ``begin``/``write`` calls."""
        if self._index != -1:
            raise SafetensorsWriteError("regions() after tensors were written in order")
        out, start = [], self.data_start
        for entry in self.entries:
            out.append(Region(self._open_fd(), entry.name, start, start + entry.nbytes))
            start += entry.nbytes
        return out

    def regions_done(self, regions: Sequence[Region]) -> None:
        """Every region complete: the file is as if each tensor had been written in order."""
        for region in regions:
            if region.pos != region.end:
                raise SafetensorsWriteError(f"{region.name}: {region.end - region.pos} bytes missing")
        self._index, self._pos = len(self.entries) - 1, self.nbytes
        self._entry_end = self.nbytes

    # -- completion ------------------------------------------------------------------------

    def finish(self) -> None:
        """Check completeness, fsync and close (the file keeps its temporary name)."""
        if self._pos != self._entry_end or self._index != len(self.entries) - 1:
            written = max(self._index, 0)
            raise SafetensorsWriteError(f"{self.path.name}: only {written} of {len(self.entries)} tensors written")
        if self._pos != self.nbytes:
            raise SafetensorsWriteError(f"{self.path.name}: wrote {self._pos} bytes, expected {self.nbytes}")
        fd = self._open_fd()
        fsync(fd)
        os.close(fd)
        self._fd = None

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.tmp_path.unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------

    def _open_fd(self) -> int:
        if self._fd is None:
            raise SafetensorsWriteError(f"{self.path.name}: written after finish() or abort()")
        return self._fd

    def _check_room(self, nbytes: int) -> None:
        if self._index < 0:
            raise SafetensorsWriteError("write before begin()")
        if self._pos + nbytes > self._entry_end:
            raise SafetensorsWriteError(
                f"{self.entries[self._index].name}: {self._pos + nbytes - self._entry_end} bytes too many"
            )

    def _write_all(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            io_point("write")
            n = os.pwrite(self._open_fd(), view, self._pos)
            self._pos += n
            view = view[n:]
