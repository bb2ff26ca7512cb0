"""``Manifest.to_dict`` (params dumped by C loops where they are plain) is pydantic's ``model_dump``
exactly, key order included, for manifests of a real DeepSpeed save and for params that are not
plain (digests, unknown fields, built by validation); and the document is the caller's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptspec.deepspeed.describe.zero import manifest_from_checkpoint
from ckptspec.format.manifest_dict import DUMP, manifest_dict, plain_params
from ckptspec.format.models import Manifest, Param

SAVE = Path(__file__).resolve().parents[1] / "data" / "deepspeed-0.19.8" / "s2-bf16-ws2"  # a real DeepSpeed save


def _exactly(manifest: Manifest) -> None:
    expected = manifest.model_dump(**DUMP)
    # json.dumps without sort_keys: equal text means equal values and equal key order at every level.
    assert json.dumps(manifest_dict(manifest)) == json.dumps(expected)
    assert json.dumps(manifest.to_dict()) == json.dumps(expected)


@pytest.fixture(scope="module")
def described() -> Manifest:
    return manifest_from_checkpoint(SAVE)


def test_a_real_saves_manifest_is_model_dump_with_its_params_dumped_plainly(described):
    assert all(plain_params(g.params) is not None for g in described.groups if g.params)
    _exactly(described)


def test_hashed_params_are_dumped_by_pydantic_and_the_same():
    hashed = manifest_from_checkpoint(SAVE, hash_algorithm="sha256")
    assert any(plain_params(g.params) is None for g in hashed.groups)  # digests: not plain
    _exactly(hashed)


def test_params_that_are_not_plain_are_dumped_by_pydantic_and_the_same(described):
    doc = described.model_dump(**DUMP)
    params = doc["groups"][0]["params"]
    params[0]["future_field"] = [1, 2]  # a newer minor version's fields, kept by a tolerant read
    doc["groups"][0]["future_group_field"] = "after the defined fields"
    tolerant = Manifest.model_validate(doc, context={"allow_unknown": True})
    assert plain_params(tolerant.groups[0].params) is None
    _exactly(tolerant)

    validated = Manifest.model_validate(described.model_dump(**DUMP))  # built by validation, not by a producer
    assert plain_params(validated.groups[0].params) is not None
    _exactly(validated)

    mixed = described.model_copy(deep=True)
    made = Param.model_construct(name="w", shape=[2], numel=2, dtype="float32", offset=0, padding=0, digest=None)
    mixed.groups[0].params[1] = made
    assert plain_params(mixed.groups[0].params) is None  # a digest set (to null): not exactly the plain fields
    _exactly(mixed)

    emptied = described.model_copy(deep=True)
    emptied.groups[0].params = []
    _exactly(emptied)


def test_the_document_is_the_callers_own(described):
    model = described.model_copy(deep=True)
    doc = model.to_dict()
    first = doc["groups"][0]["params"][0]
    first["shape"].append(7)
    first["name"] = "changed"
    del doc["groups"][0]["params"][1]["numel"]
    assert json.dumps(model.model_dump(**DUMP)) == json.dumps(described.model_dump(**DUMP))
