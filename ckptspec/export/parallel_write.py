"""Filling one safetensors file from several threads (``reconstruct --jobs N``).

Every tensor has its place in the file once the header is written (``SafetensorsWriter.regions``),
so threads can fill tensors in any order. A tensor copied as it is stored (same dtype, no digest to
check) is cut into pieces of at most ``PIECE`` bytes, each a task of its own, so that one large
embedding does not keep a single thread busy; a tensor that is cast or hashed is one task (its
digest runs over its bytes in order). ``copy_file_range``, ``pread``/``pwrite``, hashlib and
numpy's casts release the GIL, so the threads do run at once. Local files only: a remote
checkpoint is read as one planned stream of range requests (``arrays.ShardReader``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import SafetensorsWriteError
from .arrays import ShardReader, stream
from .model_plan import Segment, TensorSource
from .safetensors_writer import Region, SafetensorsWriter

PIECE = 64 << 20  # bytes per task when a tensor is copied as stored


def all_local(sources: Sequence[TensorSource]) -> bool:
    return all(isinstance(seg.path, Path) for source in sources for seg in source.segments)


def fill_parallel(
    writer: SafetensorsWriter,
    sources: Sequence[TensorSource],
    dtypes: Sequence[str],
    jobs: int,
    progress: Callable[[int], None],
) -> None:
    """Write every tensor of ``writer`` (``sources[i]`` cast to ``dtypes[i]``) with ``jobs`` threads."""
    lock = threading.Lock()
    local = threading.local()
    readers: list[ShardReader] = []

    def report(n: int) -> None:
        with lock:
            progress(n)

    def reader() -> ShardReader:  # one set of open files per thread
        files = getattr(local, "files", None)
        if files is None:
            files = local.files = ShardReader()
            with lock:
                readers.append(files)
        return files

    def copy_piece(segment: Segment, region: Region) -> None:
        reader().copy(segment, region)
        report(segment.nbytes)

    def whole(source: TensorSource, dtype: str, region: Region) -> None:
        stream(source, dtype, region, reader(), report)

    regions = writer.regions()
    tasks: list[Callable[[], None]] = []
    split: list[tuple[Region, list[Region]]] = []
    for region, source, dtype in zip(regions, sources, dtypes):
        if source.dtype != dtype or source.digest is not None:
            tasks.append(functools.partial(whole, source, dtype, region))
            continue
        parts, skip = [], 0
        for seg in source.segments:
            for start in range(0, seg.nbytes, PIECE):
                n = min(PIECE, seg.nbytes - start)
                part = region.part(skip, n)
                parts.append(part)
                piece = Segment(seg.path, seg.offset + start, n)
                tasks.append(functools.partial(copy_piece, piece, part))
                skip += n
        split.append((region, parts))
    try:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptspec-write") as pool:
            futures = [pool.submit(task) for task in tasks]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        for files in readers:
            files.close()
    for region, parts in split:
        if any(part.pos != part.end for part in parts):
            raise SafetensorsWriteError(f"{region.name}: a piece was not written")
        region.pos = region.end
    writer.regions_done(regions)
