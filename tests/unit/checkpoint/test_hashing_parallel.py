"""``file_digests`` (threads) gives what ``file_digest`` gives one file at a time, in order."""

from __future__ import annotations

import hashlib

import pytest

from ckptspec.checkpoint.hashing import file_digest, file_digests


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b"])
@pytest.mark.parametrize("jobs", [None, 1, 3])
def test_same_digests_in_order(tmp_path, algorithm, jobs):
    paths = []
    for i, size in enumerate([0, 1, (1 << 20) + 7, 3 << 20, 5]):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * size)
        paths.append(p)
    got = file_digests(paths, algorithm, jobs)
    assert got == [file_digest(p, algorithm) for p in paths]
    assert [h.digest for h in got] == [hashlib.new(algorithm, p.read_bytes()).hexdigest() for p in paths]


def test_first_missing_file_in_order_is_raised(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="missing-1"):
        file_digests([good, tmp_path / "missing-1", tmp_path / "missing-2"], "sha256", 3)
