"""``export/tensor_cuts.py``: a tensor rank's shard of a whole tensor cut along one axis in blocks (sub-parameters).

Oracle: numpy, element by element: the shard of rank r of T is, along the axis, the r-th of T equal parts of every
block, concatenated in block order (what DeepSpeed's SubParamColumnParallel holds). The runs, the affine pieces and
the blocks read back from the pieces of another degree must all give it; what is not such a layout is refused (CK410).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptspec.errors import ReshardUnsupported
from ckptspec.export.tensor_cuts import Cut, affine_pieces, check_degree, cut_of_pieces, shard_runs, shard_shape
from ckptspec.format.index_models import Piece


@st.composite
def cuts(draw):
    """(whole shape, cut, source degree, target degree): every block a multiple of both degrees."""
    t, big_t = draw(st.sampled_from([2, 4])), draw(st.sampled_from([1, 2, 3, 4]))  # an AutoTP source: t > 1
    unit = t * big_t // math.gcd(t, big_t)
    blocks = tuple(unit * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    axis = draw(st.integers(0, len(shape) - 1))
    shape[axis] = sum(blocks)
    return shape, Cut(axis, blocks), t, big_t


def _expected(whole: np.ndarray, cut: Cut, rank: int, degree: int) -> np.ndarray:
    parts, start = [], 0
    for block in cut.blocks:
        part = block // degree
        parts.append(np.take(whole, range(start + rank * part, start + (rank + 1) * part), axis=cut.axis))
        start += block
    return np.concatenate(parts, axis=cut.axis)


def _by_pieces(whole: np.ndarray, pieces: list[dict], local: list[int]) -> np.ndarray:
    flat, out = whole.reshape(-1), np.full(int(np.prod(local)), -1, dtype=whole.dtype)
    item = whole.itemsize
    for p in pieces:
        src = np.lib.stride_tricks.as_strided(flat[p["source"][0] :], p["shape"], [s * item for s in p["source"][1]])
        dst = np.lib.stride_tricks.as_strided(out[p["dest"][0] :], p["shape"], [s * item for s in p["dest"][1]])
        dst[...] = src
    return out.reshape(local)


def _index_piece(piece: dict) -> Piece:
    """A piece as the checkpoint index holds it (DeepSpeed's ``locations`` is not kept)."""
    return Piece.model_validate({k: v for k, v in piece.items() if k != "locations"})


@settings(max_examples=200, deadline=None)
@given(cuts())
def test_runs_pieces_and_blocks_read_back_give_each_ranks_shard(case):
    shape, cut, t, big_t = case
    whole = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for rank in range(big_t):
        expected = _expected(whole, cut, rank, big_t)
        assert shard_shape(shape, cut, big_t) == list(expected.shape)
        runs = np.concatenate([whole.reshape(-1)[a : a + n] for a, n in shard_runs(shape, cut, rank, big_t)])
        assert np.array_equal(runs, expected.reshape(-1))
        assert np.array_equal(_by_pieces(whole, affine_pieces(shape, cut, rank, big_t), list(expected.shape)), expected)
    source = [[_index_piece(p) for p in affine_pieces(shape, cut, r, t)] for r in range(t)]
    assert cut_of_pieces("w", shape, source) == cut


def test_blocks_one_degree_cannot_cut_are_refused_by_name():
    says = r"w has its sub-parameters of \[32, 32\] elements.*--tensor-parallel 3"
    with pytest.raises(ReshardUnsupported, match=says):
        check_degree("w", Cut(0, (32, 32)), 3)


def _piece(shape, source, dest):
    return Piece.model_validate({"shape": shape, "source": source, "dest": dest})


def test_pieces_that_are_not_row_blocks_along_one_axis_are_refused():
    # rank 0 holds a block along axis 0, rank 1 one along axis 1
    ranks = [[_piece([2, 4], [0, [4, 1]], [0, [4, 1]])], [_piece([4, 2], [2, [4, 1]], [0, [2, 1]])]]
    with pytest.raises(ReshardUnsupported, match="w: its affine pieces are not sub-parameters"):
        cut_of_pieces("w", [4, 4], ranks)
    # a block of rank 1 that does not follow rank 0's in the whole tensor
    ranks = [[_piece([2, 4], [0, [4, 1]], [0, [4, 1]])], [_piece([2, 4], [0, [4, 1]], [0, [4, 1]])]]
    with pytest.raises(ReshardUnsupported, match="piece 0 of tensor rank 1 is not the next block"):
        cut_of_pieces("w", [4, 4], ranks)
    # uneven parts of one sub-parameter
    ranks = [[_piece([3, 4], [0, [4, 1]], [0, [4, 1]])], [_piece([1, 4], [12, [4, 1]], [0, [4, 1]])]]
    with pytest.raises(ReshardUnsupported, match="cut unevenly"):
        cut_of_pieces("w", [4, 4], ranks)
