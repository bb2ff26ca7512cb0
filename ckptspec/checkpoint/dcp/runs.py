"""A DCP chunk's elements as contiguous runs of its whole tensor: what a reconstruction copies and a digest reads in
order. Standard library only."""

from __future__ import annotations

import math
from collections.abc import Iterator

from .metadata import Chunk


def runs(whole: tuple[int, ...], chunk: Chunk) -> Iterator[tuple[int, int, int]]:
    """The chunk's elements as contiguous runs of the whole tensor: (element offset in the chunk's row-major bytes,
    element offset in the whole tensor's, elements). The trailing dimensions the chunk spans whole are one run."""
    ndim = len(whole)
    k = ndim  # dims k.. are spanned whole by the chunk
    while k > 0 and chunk.offsets[k - 1] == 0 and chunk.sizes[k - 1] == whole[k - 1]:
        k -= 1
    if k == 0:
        yield 0, 0, chunk.numel
        return
    # dim k-1 is the innermost partial one: a run is sizes[k-1] * prod(whole[k:]) elements
    inner = math.prod(whole[k:])
    length = chunk.sizes[k - 1] * inner
    strides = [math.prod(whole[d + 1 :]) for d in range(ndim)]
    src = 0
    for outer in _indices(chunk.sizes[: k - 1]):
        dst = sum((chunk.offsets[d] + i) * strides[d] for d, i in enumerate(outer))
        dst += chunk.offsets[k - 1] * strides[k - 1]
        yield src, dst, length
        src += length


def _indices(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _indices(sizes[1:]):
            yield (i, *rest)
