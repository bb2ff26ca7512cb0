"""How ``reshard --tensor-parallel T`` cuts one whole tensor: along one axis, in one or more blocks (sub-parameters).

A column- or row-parallel tensor is one block along its axis: tensor rank ``r`` of ``T`` holds the ``r``-th of ``T``
equal parts. A fused tensor (AutoTP's ``GateUpPack_LinearLayer``, ``SubParamLinearLayer``: gate and up halves, or q,
k, v) is several blocks one after the other along the axis, and each rank's shard is its part of every block,
concatenated in block order: what DeepSpeed's ``SubParamColumnParallel`` cuts at any degree, and what its affine_map
records as one piece per block.

``cut_of_pieces`` reads the blocks back from the source's affine pieces (every tensor rank's); what it cannot read as
blocks along one axis, and a block ``T`` does not divide, is refused by name (CK410) before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import ReshardUnsupported


@dataclass(frozen=True)
class Cut:
    axis: int
    blocks: tuple[int, ...]  # the block lengths along ``axis``, in whole order (a plain split: one block)


def plain(shape: list[int], axis: int) -> Cut:
    return Cut(axis, (shape[axis],))


def check_degree(name: str, cut: Cut, degree: int) -> None:
    bad = [b for b in cut.blocks if b % degree]
    if bad:
        what = f"its sub-parameters of {list(cut.blocks)} elements" if len(cut.blocks) > 1 else f"{bad[0]} elements"
        raise ReshardUnsupported(
            f"{name} has {what} along its split axis {cut.axis}: not a multiple of --tensor-parallel {degree}",
            "give a degree that divides every split axis (every sub-parameter of a fused weight)",
        )


def shard_shape(shape: list[int], cut: Cut, degree: int) -> list[int]:
    return [*shape[: cut.axis], shape[cut.axis] // degree, *shape[cut.axis + 1 :]]


def shard_runs(shape: list[int], cut: Cut, rank: int, degree: int) -> Iterator[tuple[int, int]]:
    """(whole flat start, count) of tensor rank ``rank``'s shard, in the shard's order: per row of the axes before
    ``cut.axis``, its part of each block."""
    inner, outer = math.prod(shape[cut.axis + 1 :]), math.prod(shape[: cut.axis])
    stride = shape[cut.axis] * inner
    parts, start = [], 0
    for block in cut.blocks:
        part = block // degree
        if part:
            parts.append(((start + rank * part) * inner, part * inner))
        start += block
    return ((o * stride + first, count) for o in range(outer) for first, count in parts)


def affine_pieces(shape: list[int], cut: Cut, rank: int, degree: int) -> list[dict]:
    """DeepSpeed's affine_map pieces of tensor rank ``rank``'s shard: one per block (``locations``: the rank)."""
    local = shard_shape(shape, cut, degree)
    strides, local_strides = _strides(shape), _strides(local)
    pieces, start, at = [], 0, 0
    for block in cut.blocks:
        part = block // degree
        piece_shape = [*shape[: cut.axis], part, *shape[cut.axis + 1 :]]
        source = (start + rank * part) * strides[cut.axis]
        pieces.append(
            {
                "shape": piece_shape,
                "source": [source, strides],
                "dest": [at * local_strides[cut.axis], local_strides],
                "locations": [rank],
            }
        )
        start, at = start + block, at + part
    return pieces


def _strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def cut_of_pieces(name: str, shape: list[int], ranks: list[list]) -> Cut:
    """The blocks of ``name`` (whole ``shape``) from each tensor rank's affine pieces (``ranks[r]``: rank ``r``'s
    pieces, ``index_models.Piece``): every piece a block of whole rows along one axis, each rank's pieces stacked in
    its shard in block order, piece ``j`` of the ranks side by side in rank order making block ``j``."""
    strides = _strides(shape)
    counts = {len(pieces) for pieces in ranks}
    axes = {a for pieces in ranks for p in pieces for a, (n, w) in enumerate(zip(p.shape, shape, strict=True)) if n < w}
    if len(counts) != 1 or len(axes) != 1:
        raise _unreadable(name, "its shards hold different numbers of pieces, or pieces cut along several axes")
    (axis,) = axes
    (count,) = counts
    outer = strides[axis - 1] if axis else math.prod(shape)
    blocks: list[int] = []
    at = 0
    for j in range(count):
        for r, pieces in enumerate(ranks):
            p = pieces[j]
            offset, source_strides = p.source
            dest_offset, dest_strides = p.dest
            before = sum(q.shape[axis] for q in pieces[:j])
            local = [*shape[:axis], sum(q.shape[axis] for q in pieces), *shape[axis + 1 :]]
            if (
                list(source_strides) != strides
                or list(dest_strides) != _strides(local)
                or offset != at * strides[axis]
                or offset >= outer
                or dest_offset != before * dest_strides[axis]
            ):
                raise _unreadable(name, f"piece {j} of tensor rank {r} is not the next block of whole rows")
            at += p.shape[axis]
        blocks.append(at - sum(blocks))
    if at != shape[axis]:
        raise _unreadable(name, f"its pieces cover {at} of the {shape[axis]} elements along axis {axis}")
    if any(pieces[j].shape[axis] * len(ranks) != blocks[j] for pieces in ranks for j in range(count)):
        raise _unreadable(name, "a sub-parameter is cut unevenly over the tensor ranks")
    return Cut(axis, tuple(blocks))


def _unreadable(name: str, why: str) -> ReshardUnsupported:
    return ReshardUnsupported(
        f"{name}: its affine pieces are not sub-parameters cut along one axis ({why})",
        "only column- and row-parallel tensors and fused sub-parameter weights (AutoTP's GateUpPack and "
        "SubParam layers) are cut for another tensor degree; merge it (--tensor-parallel 1) instead",
    )
