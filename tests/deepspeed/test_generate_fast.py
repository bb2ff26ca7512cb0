"""``generate``'s fast path writes the bytes of the reference path, on real DeepSpeed checkpoints.

The fast path (issue #19) writes indented JSON with orjson (``format/json_fast.py``); the reference
path: JSON by the standard library (the models are built one way since #38: validated). Every
matrix point and the model-parallel checkpoints (a checkpoint index), with and without ``--hash``.
``benchmarks/check_identical.py`` compares with another build's bytes (main's) at 10k-100k tensors.
"""

from __future__ import annotations

import pytest
from _harness.scenarios import MATRIX, PARALLEL

from ckptspec.deepspeed.describe import describe
from ckptspec.format.codec import dumps

MODEL_PARALLEL = [n for n in PARALLEL if n.startswith(("pp2", "tp2")) and "-s0-" not in n]  # stage 0: refused


def _document(path, hash_algorithm):
    return describe(path, None, hash_algorithm=hash_algorithm)  # as `ckptspec generate` builds it


@pytest.mark.parametrize("hash_algorithm", [None, "sha256"])
@pytest.mark.parametrize("name", MATRIX + MODEL_PARALLEL)
def test_fast_path_bytes_equal_reference_bytes(name, hash_algorithm, ds):
    document = _document(ds.path(name), hash_algorithm)
    fast = dumps(document)
    assert fast == dumps(document, reference=True)
    assert b'"params"' in fast or b'"manifests"' in fast  # a real document, not an empty one
