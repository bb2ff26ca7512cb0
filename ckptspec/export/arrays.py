"""Tensor bytes out of the shard files, and dtype conversion with numpy (torch's rounding, bit for bit).

Files are read with ``pread`` through one descriptor each (no mmap: RSS stays flat), tensor
by tensor, in chunks; a copy without dtype change goes file-to-file in the kernel
(``copy_file_range``), unless the tensor has a digest (format 1.1): its bytes then pass through
here once, hashed on the way, and a mismatch stops the reconstruction (CK222) before the output
appears. numpy is imported on first use.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from .. import split
from ..checkpoint.states import unreadable
from ..errors import (
    FileHashMismatch,
    InputOutputError,
    ReconstructUnsupported,
    TensorDigestMismatch,
    TruncatedFile,
)
from ..format.dtypes import ITEMSIZE
from ..format.models import Hash
from ..location import CHUNK, FileHashes, HashingStream, RangeStream, RemotePath, fetch_range
from .model_plan import Segment, TensorSource
from .safetensors_writer import TensorSink

CHUNK_BYTES = 16 << 20  # dtype conversion works on at most this many source bytes at once


def _np():
    try:
        import numpy
    except ImportError:  # pragma: no cover - environment problem
        raise ReconstructUnsupported("converting dtypes needs numpy", "pip install numpy") from None
    return numpy


def _np_dtype(dtype: str):
    np = _np()
    table = {
        "float64": np.float64,
        "float32": np.float32,
        "float16": np.float16,
        "bfloat16": np.uint16,
        "int64": np.int64,
        "int32": np.int32,
        "int16": np.int16,
        "int8": np.int8,
        "uint8": np.uint8,
        "bool": np.bool_,
        "complex64": np.complex64,
        "complex128": np.complex128,
    }
    if dtype not in table:
        raise ReconstructUnsupported(
            f"tensors of dtype {dtype} cannot be converted without torch",
            "use --dtype matching the stored dtype, or a float, integer or bool dtype",
        )
    return np.dtype(table[dtype]).newbyteorder("<")


def convert(array, src: str, dst: str):
    """Cast a flat little-endian array of manifest dtype ``src`` to ``dst`` like torch's ``.to()``.

    bfloat16 is carried as uint16 bit patterns (numpy has no bfloat16): widening is
    ``bits << 16``; narrowing rounds to nearest even (NaN -> 0x7FC0, as c10::BFloat16).
    """
    np = _np()
    if src == dst:
        return array
    if src == "bfloat16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
        src = "float32"
        if dst == "float32":
            return array
    if dst == "bfloat16":
        f32 = array if src == "float32" else array.astype(np.float32)
        bits = f32.view(np.uint32)
        rounded = bits >> 16  # in place from here on: one temporary per chunk
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(f32)
        if nan.any():
            out[nan] = 0x7FC0
        return out
    with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
        return array.astype(_np_dtype(dst))


class ShardReader:
    """Open file descriptors, one per shard file, read with pread (no mmap: RSS stays flat).

    A remote shard (``location.RemotePath``) is read in range requests instead: ``plan`` announces
    the segments in the order they will be read, and a ``RangeStream`` fetches them ahead, a few
    requests in flight, so memory stays bounded whatever the tensor sizes; a read that was not
    planned is fetched when asked. ``hashes``: remote files whose recorded hash this reader checks
    (``verify``), fetching each once, front to back: the segments, and the bytes between them.
    """

    def __init__(self, hashes: dict[RemotePath, Hash] | None = None):
        self._fds: dict[Path, int] = {}
        self._stream: RangeStream | HashingStream | None = None
        self._left: tuple[RemotePath, int, memoryview] | None = None  # the unread rest of a fetched piece
        self._recorded = hashes or {}
        self._hashes = FileHashes({p: h.algorithm for p, h in self._recorded.items()}) if hashes else None

    def plan(self, segments: Iterable[Segment]) -> None:
        """The segments the next reads take, in order (only remote ones matter: they are fetched ahead)."""
        self._close_stream()
        remote = [(s.path, s.offset, s.offset + s.nbytes) for s in segments if isinstance(s.path, RemotePath)]
        if remote:
            self._stream = RangeStream(remote) if self._hashes is None else HashingStream(remote, self._hashes)

    def verify(self) -> None:
        """Raise CK209 (``FileHashMismatch``) unless every file of ``hashes`` holds its recorded hash: the
        bytes no read took are fetched now, so each file is fetched once, whole. Call it before committing."""
        if self._hashes is None:
            return
        self._close_stream()
        actual = self._hashes.finish()
        for path, recorded in self._recorded.items():
            if actual[path] != recorded.digest:
                raise FileHashMismatch(str(path), recorded.algorithm, actual[path], recorded.digest)

    def copy(self, segment: Segment, writer: TensorSink) -> None:
        """Append the segment's bytes to ``writer``: in the kernel for a local file, piece by piece for a remote one."""
        split.count_read(segment.nbytes)
        if isinstance(segment.path, RemotePath):
            for piece in self._pieces(segment):
                writer.write(piece)
            return
        writer.copy_range(self.fd(segment.path), segment.offset, segment.nbytes)

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise InputOutputError(
                    "CK901", f"cannot read: {exc.strerror}", "check the file exists and is readable", str(path)
                ) from None
        return self._fds[path]

    def read_into(self, segment: Segment, out: memoryview) -> None:
        split.count_read(segment.nbytes)
        if isinstance(segment.path, RemotePath):
            done = 0
            for piece in self._pieces(segment):
                out[done : done + len(piece)] = piece
                done += len(piece)
            return
        fd, done = self.fd(segment.path), 0
        while done < segment.nbytes:
            n = os.preadv(fd, [out[done : segment.nbytes]], segment.offset + done)
            if n <= 0:
                raise unreadable(
                    TruncatedFile(segment.path, f"file ends before byte {segment.offset + segment.nbytes}")
                )
            done += n

    def _pieces(self, segment: Segment) -> Iterator[memoryview]:
        """The bytes of a remote segment, in pieces: from the planned stream when it is at this
        segment, else fetched now (and the stream, out of step, is dropped)."""
        path, at, end = segment.path, segment.offset, segment.offset + segment.nbytes
        assert isinstance(path, RemotePath)  # the callers read local segments from a descriptor
        while at < end:
            if self._left is not None and self._left[0] == path and self._left[1] == at:
                data = self._left[2]
            elif self._stream is not None and self._stream.peek() == (path, at):
                fetched = self._stream.next()
                assert fetched is not None  # peek() saw it
                data = memoryview(fetched[2])
            else:
                self._close_stream()
                data = memoryview(fetch_range(path, at, min(end, at + CHUNK)))
                if self._hashes is not None:
                    self._hashes.feed(path, at, data)
            take = min(len(data), end - at)
            self._left = (path, at + take, data[take:]) if take < len(data) else None
            yield data[:take]
            at += take

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._left = None

    def close(self) -> None:
        self._close_stream()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_digest(source: TensorSource, digest) -> None:
    """Raise CK222 unless ``digest`` (a hashlib object over the source's bytes) is the recorded one."""
    if source.digest is not None and digest.hexdigest() != source.digest:
        files = sorted({str(s.path.name) for s in source.segments})
        raise TensorDigestMismatch(source.name, digest.hexdigest(), source.digest, files)


def read_array(source: TensorSource, dtype: str, files: ShardReader):
    """The whole tensor as a numpy array of ``dtype`` (bfloat16 as uint16 bits), in its shape.

    Its bytes are checked against the source's digest first, when it has one (CK222).
    """
    np = _np()
    raw = np.empty(source.numel, dtype=_np_dtype(source.dtype))
    view, pos = memoryview(raw).cast("B"), 0
    for segment in source.segments:
        files.read_into(segment, view[pos : pos + segment.nbytes])
        pos += segment.nbytes
    if source.digest is not None:
        check_digest(source, hashlib.sha256(view))
    return convert(raw, source.dtype, dtype).reshape(source.shape)


def iter_chunks(segments, src: str, dtype: str, files: ShardReader, source: TensorSource | None = None):
    """The elements of ``segments`` (stored as ``src``) cast to ``dtype``, at most ``CHUNK_BYTES`` source
    bytes at a time, each chunk a fresh flat array. With ``source`` (whose segments these are) the
    bytes are hashed and its digest checked after the last chunk (CK222)."""
    np = _np()
    item = ITEMSIZE[src]
    chunk = max(item, CHUNK_BYTES // item * item)
    digest = hashlib.sha256() if source is not None and source.digest is not None else None
    for segment in segments:
        for start in range(0, segment.nbytes, chunk):
            n = min(chunk, segment.nbytes - start)
            raw = np.empty(n // item, dtype=_np_dtype(src))
            files.read_into(Segment(segment.path, segment.offset + start, n), memoryview(raw).cast("B"))
            if digest is not None:
                digest.update(memoryview(raw).cast("B"))
            yield convert(raw, src, dtype)
    if digest is not None:
        assert source is not None  # a digest is made for a source only
        check_digest(source, digest)


def iter_zeros(dtype: str, count: int):
    """``count`` zeros of ``dtype``, at most ``CHUNK_BYTES`` at a time."""
    np = _np()
    step = max(1, CHUNK_BYTES // ITEMSIZE[dtype])
    for start in range(0, count, step):
        yield np.zeros(min(step, count - start), dtype=_np_dtype(dtype))


def stream(source: TensorSource, dtype: str, writer: TensorSink, files: ShardReader, progress) -> None:
    """Append the tensor to ``writer``: a kernel copy when neither a cast nor a digest needs the
    bytes, else chunked reads (hashed) and casts."""
    if source.dtype == dtype and source.digest is None:
        for segment in source.segments:
            files.copy(segment, writer)
            progress(segment.nbytes)
        return
    np = _np()
    for out in iter_chunks(source.segments, source.dtype, dtype, files, source):
        writer.write(np.ascontiguousarray(out))
        progress(out.size * ITEMSIZE[dtype])
