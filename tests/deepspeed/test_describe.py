"""``describe``: the one verb from a checkpoint's files to its document, whatever its kind.

It gives what ``ckptspec generate`` writes: the manifest of a plain ZeRO checkpoint, the checkpoint
index of every other kind, each equal to what its kind's module describes (real DeepSpeed checkpoints).
"""

from __future__ import annotations

import pytest
from _harness.scenarios import MATRIX, PARALLEL

import ckptspec
from ckptspec.checkpoint.states import StateCache
from ckptspec.deepspeed.describe import model_parallel, moe, zero
from ckptspec.deepspeed.kinds import Kind, kind_of_dir
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
from ckptspec.format.models import Manifest

KINDS = [MATRIX[0], *(next(n for n in PARALLEL if n.startswith(prefix)) for prefix in ("tp2", "moe"))]
MODULE_OF_KIND = {Kind.ZERO: zero, Kind.MODEL_PARALLEL: model_parallel, Kind.MOE: moe}


@pytest.mark.parametrize("name", KINDS)
def test_describe_gives_the_kinds_document(name, ds):
    path = ds.path(name)
    tag_dir = resolve_tag_dir(path, None)
    document = ckptspec.describe(path, hash_algorithm="sha256")
    expected = MODULE_OF_KIND[kind_of_dir(tag_dir)].describe(tag_dir, StateCache(), "sha256")
    assert type(document) is type(expected)
    assert document.to_dict() == expected.to_dict()
    assert isinstance(document, Manifest) == (name in MATRIX)
