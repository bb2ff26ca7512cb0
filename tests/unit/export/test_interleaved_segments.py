"""A tensor-parallel tensor's whole segments (``compose_plan.compose_source``), made as they are read
(``InterleavedSegments``), are the list the eager composition held: every element of the whole tensor, in order,
at the bytes of the shard that holds it, neighbours in one file joined.

Oracle: element by element on small random layouts (1 to 3 axes; a split along any axis into shards of any
length, or DeepSpeed's affine pieces for shards holding several blocks; shard sources cut into segments
of several files, some back to back so that they join, across shards too). A layout that leaves an element
unset or sets one twice is refused before anything is read (CK400's ReconstructMismatch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.errors import ReconstructMismatch
from ckptspec.export.compose_plan import InterleavedSegments, compose_source
from ckptspec.export.model_plan import Segment, TensorSource
from ckptspec.format.dtypes import ITEMSIZE
from ckptspec.format.index_models import Shard

FILES = [Path("/ckpt/a.pt"), Path("/ckpt/b.pt")]


def _strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


@st.composite
def layouts(draw):
    """(whole shape, axis, blocks: (rank, start, length) along the axis, in order, ranks)."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    axis = draw(st.integers(0, len(shape) - 1))
    ranks = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(1, shape[axis] - 1), max_size=3, unique=True)) if shape[axis] > 1 else [])
    edges = [0, *cuts, shape[axis]]
    owners = draw(st.lists(st.integers(0, ranks - 1), min_size=len(edges) - 1, max_size=len(edges) - 1))
    blocks = [(owners[i], edges[i], edges[i + 1] - edges[i]) for i in range(len(edges) - 1)]
    return shape, axis, blocks, ranks


def _placement(shape: list[int], axis: int, mine: list[tuple[int, int]], split: bool):
    """The shard holding ``mine`` ((start, length) blocks along ``axis``, in the shard's own order): a split when
    asked and it is one block, else its affine pieces (whole (offset, strides) -> local (offset, strides))."""
    local = [*shape[:axis], sum(n for _, n in mine), *shape[axis + 1 :]]
    if split and len(mine) == 1:
        return local, {"split": {"axis": axis, "offset": mine[0][0], "length": mine[0][1]}}
    pieces, at = [], 0
    for start, n in mine:
        piece_shape = [*shape[:axis], n, *shape[axis + 1 :]]
        whole_at = start * _strides(shape)[axis]
        local_at = at * _strides(local)[axis]
        pieces.append(
            {"shape": piece_shape, "source": [whole_at, _strides(shape)], "dest": [local_at, _strides(local)]}
        )
        at += n
    return local, {"pieces": pieces}


def _source(draw, name: str, numel: int, dtype: str, cursor: dict) -> TensorSource:
    """``numel`` elements in segments of the two files, each after the last one written there (or a gap)."""
    item = ITEMSIZE[dtype]
    cuts = sorted(draw(st.lists(st.integers(1, numel - 1), max_size=3, unique=True)) if numel > 1 else [])
    edges = [0, *cuts, numel]
    segments = []
    for a, b in zip(edges, edges[1:]):
        path = draw(st.sampled_from(FILES))
        cursor[path] += draw(st.sampled_from([0, 0, item, 3]))  # back to back (joins), or apart
        segments.append(Segment(path, cursor[path], (b - a) * item))
        cursor[path] += (b - a) * item
    return TensorSource(name, (numel,), dtype, segments, "trainable")


def _element_bytes(source: TensorSource, element: int) -> Segment:
    item = ITEMSIZE[source.dtype]
    pos = element * item
    for seg in source.segments:
        if pos < seg.nbytes:
            return Segment(seg.path, seg.offset + pos, item)
        pos -= seg.nbytes
    raise AssertionError("outside the source")


def _oracle(shape: list[int], axis: int, blocks, sources: dict[int, TensorSource], orders) -> list[Segment]:
    """Every whole element's bytes, in order, joined where they are back to back in one file (``orders``: each
    rank's blocks as its shard holds them)."""
    out: list[Segment] = []
    inner, outer = math.prod(shape[axis + 1 :]), math.prod(shape[:axis])
    for o in range(outer):
        for c in range(shape[axis]):
            rank, start, _ = next(b for b in blocks if b[1] <= c < b[1] + b[2])
            held = orders[rank]
            before = sum(n for _, n in held[: held.index((start, _length(blocks, rank, start)))])  # rows held first
            local_axis = sum(n for r, _, n in blocks if r == rank)
            for k in range(inner):
                element = (o * local_axis + before + c - start) * inner + k
                seg = _element_bytes(sources[rank], element)
                if out and out[-1].path == seg.path and out[-1].offset + out[-1].nbytes == seg.offset:
                    out[-1] = Segment(seg.path, out[-1].offset, out[-1].nbytes + seg.nbytes)
                else:
                    out.append(seg)
    return out


def _length(blocks, rank: int, start: int) -> int:
    return next(n for r, s, n in blocks if r == rank and s == start)


def _shards(draw, shape, axis, blocks, ranks, dtype):
    """The shards and their sources; each rank holds its blocks in whole order or permuted (a shard holding two
    blocks that meet in the whole tensor in the other order: the rows continue there, the shard's do not)."""
    cursor = {path: 0 for path in FILES}
    shards, sources, orders = [], {}, {}
    for rank in range(ranks):
        mine = draw(st.permutations([(s, n) for r, s, n in blocks if r == rank]))
        if not mine:
            continue
        orders[rank] = mine
        local, placement = _placement(shape, axis, mine, draw(st.booleans()))
        sources[rank] = _source(draw, f"w.{rank}", math.prod(local), dtype, cursor)
        shard = Shard.model_validate(
            {"domain": f"tp{rank}", "local_name": "w", "local_shape": local, "placement": placement}
        )
        shards.append((shard, sources[rank]))
    return shards, sources, orders


@settings(max_examples=300, deadline=None)
@given(layouts(), st.sampled_from(["float32", "bfloat16"]), st.data())
def test_made_as_read_equal_the_eager_list(layout, dtype, data):
    shape, axis, blocks, ranks = layout
    shards, sources, orders = _shards(data.draw, shape, axis, blocks, ranks, dtype)
    whole = compose_source("w", shape, shards, "trainable")
    expected = _oracle(shape, axis, blocks, sources, orders)
    assert isinstance(whole.segments, InterleavedSegments)
    assert list(whole.segments) == expected
    assert list(whole.segments) == expected  # made again, the same
    assert len(whole.segments) == len(expected) and whole.segments[-1] == expected[-1]


@settings(max_examples=100, deadline=None)
@given(layouts(), st.data())
def test_an_element_unset_or_set_twice_is_refused_before_reading(layout, data):
    shape, axis, blocks, ranks = layout
    shards, _, _ = _shards(data.draw, shape, axis, blocks, ranks, "float32")
    if len(shards) == 1:
        shards = shards + shards  # every element twice
    else:
        shards = shards[1:]  # the first shard's elements unset
    with pytest.raises(ReconstructMismatch, match="unset"):
        compose_source("w", shape, shards, "trainable")


def test_a_shard_source_too_short_is_refused_before_reading():
    shard = Shard.model_validate(
        {
            "domain": "tp0",
            "local_name": "w",
            "local_shape": [2, 2],
            "placement": {"split": {"axis": 1, "offset": 0, "length": 2}},
        }
    )
    source = TensorSource("w", (4,), "float32", [Segment(FILES[0], 0, 12)], "trainable")
    with pytest.raises(ReconstructMismatch, match="fewer elements"):
        compose_source("w", [2, 2], [(shard, source)], "trainable")
