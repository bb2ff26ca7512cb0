"""CK250 on hand-made DCP metadata (no torch): a tensor's chunks cover it exactly once, whatever the boxes; the real
saves and their faults are tests/dcp/test_dcp_faults.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptspec.checkpoint.dcp.checks import chunk_coverage
from ckptspec.checkpoint.dcp.metadata import Chunk, DcpMetadata, TensorEntry


def coverage(size: tuple, *chunks: tuple[tuple, tuple]) -> list[str]:
    entry = TensorEntry("float32", size, tuple(Chunk(o, s) for o, s in chunks))
    return [f.message for f in chunk_coverage(Path("."), DcpMetadata({"w": entry}, (), "1.0.0", 0))]


@pytest.mark.parametrize(
    "size,chunks",
    [
        ((), [((), ())]),  # a scalar
        ((0, 8), [((0, 0), (0, 8))]),  # no elements
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 6))]),  # dim-0 shards (FSDP2)
        ((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))]),  # dim-1 shards
        ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),  # a 2x2 grid
        ((5,), [((0,), (2,)), ((2,), (2,)), ((4,), (1,)), ((5,), (0,))]),  # uneven, an empty last shard
    ],
)
def test_exact_covers_pass(size, chunks):
    assert coverage(size, *chunks) == []


def test_a_gap_an_overlap_and_a_chunk_outside_are_named():
    assert coverage((4, 6), ((0, 0), (2, 6))) == ["w: its chunks hold 12 of its 24 elements (a gap)"]
    assert coverage((4, 6), ((0, 0), (3, 6)), ((2, 0), (2, 6))) == ["w: chunks at [0, 0] and [2, 0] overlap"]
    assert coverage((4, 6), ((0, 0), (4, 3)), ((0, 2), (4, 4))) == ["w: chunks at [0, 0] and [0, 2] overlap"]
    assert coverage((4,), ((0,), (2,)), ((2,), (3,))) == ["w: chunk at [2] of sizes [3] lies outside [4]"]
    assert coverage((), ((), ()), ((), ())) == ["w: chunks at [] and [] overlap"]


def test_many_dim0_shards_are_checked_against_their_neighbours_only():
    """A world size of 20,000 (20,000 chunks): a sweep, not every pair (400M comparisons)."""
    chunks = [((2 * i, 0), (2, 8)) for i in range(20_000)]
    assert coverage((40_000, 8), *chunks) == []
    assert coverage((40_000, 8), *chunks, ((39_999, 0), (1, 8))) == ["w: chunks at [39998, 0] and [39999, 0] overlap"]
