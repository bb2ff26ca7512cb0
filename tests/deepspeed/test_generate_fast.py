"""``generate``'s fast path writes the bytes of the reference path, on real DeepSpeed checkpoints.

The fast path (issue #19) builds ``Param`` objects and the other models a producer makes many of
without validation where their values plainly fit (``partition.make_params``, ``construct.build``)
and writes indented JSON with orjson (``format/json_fast.py``). The
reference path: every ``Param`` validated, JSON by the standard library. Every matrix point and the
model-parallel checkpoints (a checkpoint index), with and without ``--hash``.
``benchmarks/check_identical.py`` compares with another build's bytes (main's) at 10k-100k tensors.
"""

from __future__ import annotations

import pytest
from _harness.scenarios import MATRIX, PARALLEL

from ckptspec.deepspeed.describe import index_from_checkpoint
from ckptspec.deepspeed.describe.zero import manifest_from_checkpoint
from ckptspec.deepspeed.kinds import needs_index
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
from ckptspec.format import construct, partition
from ckptspec.format.codec import dumps
from ckptspec.format.models import Digest, Param

pytestmark = pytest.mark.deepspeed

MODEL_PARALLEL = [n for n in PARALLEL if n.startswith(("pp2", "tp2")) and "-s0-" not in n]  # stage 0: refused


def _document(path, hash_algorithm):
    # As `ckptspec generate` (cli/generate.py) builds it.
    if needs_index(resolve_tag_dir(path, None)):
        return index_from_checkpoint(path, None, hash_algorithm=hash_algorithm).to_dict()
    return manifest_from_checkpoint(path, None, hash_algorithm=hash_algorithm)


def _validated(name, shape, numel, dtype, offset, padding):
    return Param(name=name, shape=list(shape), numel=numel, dtype=dtype, offset=offset, padding=padding)


@pytest.mark.parametrize("hash_algorithm", [None, "sha256"])
@pytest.mark.parametrize("name", MATRIX + MODEL_PARALLEL)
def test_fast_path_bytes_equal_reference_bytes(name, hash_algorithm, ds, monkeypatch):
    path = ds.path(name)
    fast = dumps(_document(path, hash_algorithm))
    fast_msgpack = dumps(_document(path, hash_algorithm), "msgpack")
    monkeypatch.setattr(partition, "make_params", lambda *columns: [_validated(*row) for row in zip(*columns)])
    monkeypatch.setattr(construct, "CHECKS", {})  # every other model validated too
    monkeypatch.setattr(construct, "digests", lambda hexes: [Digest(sha256=h) for h in hexes])
    reference = _document(path, hash_algorithm)
    assert fast == dumps(reference, reference=True)
    assert fast_msgpack == dumps(reference, "msgpack")
    assert b'"params"' in fast or b'"manifests"' in fast  # a real document, not an empty one
