"""``describe``: the one verb from a checkpoint's files to its document, whatever its kind.

It gives what ``ckptspec generate`` writes: the manifest of a plain ZeRO checkpoint, the checkpoint
index of every other kind, each equal to its kind's producer's (real DeepSpeed checkpoints).
"""

from __future__ import annotations

import pytest
from _harness.scenarios import MATRIX, PARALLEL

from ckptspec.deepspeed.describe import describe, index_from_checkpoint
from ckptspec.deepspeed.describe.zero import manifest_from_checkpoint
from ckptspec.format.index_models import CheckpointIndex
from ckptspec.format.models import Manifest

KINDS = [MATRIX[0], *(next(n for n in PARALLEL if n.startswith(prefix)) for prefix in ("tp2", "moe"))]


@pytest.mark.parametrize("name", KINDS)
def test_describe_gives_the_kinds_document(name, ds):
    path = ds.path(name)
    document = describe(path, hash_algorithm="sha256")
    if isinstance(document, CheckpointIndex):
        assert document.to_dict() == index_from_checkpoint(path, hash_algorithm="sha256").to_dict()
    else:
        assert isinstance(document, Manifest)
        assert document.to_dict() == manifest_from_checkpoint(path, hash_algorithm="sha256").to_dict()
    assert isinstance(document, Manifest) == (name in MATRIX)
