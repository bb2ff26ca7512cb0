"""``model_build.manifest_of`` (a schema-valid document's params built in bulk) gives the models
``Manifest.model_validate`` gives, for real manifests with and without format 1.1's digests, and
leaves every document it does not build to validation; ``validate`` uses it for loaded documents."""

from __future__ import annotations

import copy
import json

import pytest

from ckptspec.deepspeed.describe.zero import manifest_from_checkpoint
from ckptspec.format import model_build
from ckptspec.format.codec import dumps
from ckptspec.format.models import Manifest
from ckptspec.format.validate import validate_decoded, validate_document

pytestmark = pytest.mark.deepspeed


def _sets(manifest: Manifest) -> list:
    """Every model's fields set, params and their digests included."""
    out = [manifest.model_fields_set]
    for group in manifest.groups:
        out.append(group.model_fields_set)
        for p in group.params:
            out.append(p.model_fields_set)
            out += [getattr(p, f).model_fields_set for f in ("digest", "model_digest") if getattr(p, f) is not None]
            out += [d.model_fields_set for d in (p.state_digests or {}).values()]
    return out


def _same(doc: dict) -> None:
    validated = Manifest.model_validate(copy.deepcopy(doc))
    built = model_build.manifest_of(copy.deepcopy(doc))
    assert built is not None
    assert dumps(built) == dumps(validated, reference=True)
    assert _sets(built) == _sets(validated)
    assert [type(p) for g in built.groups for p in g.params] == [type(p) for g in validated.groups for p in g.params]


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-bf16-ws2-sub", "s3-fp32-ws2-exclude", "s2-fp16-ws2-groups"])
@pytest.mark.parametrize("hashed", [False, True])
def test_real_manifests_are_built_as_validation_builds_them(name, hashed, ds):
    doc = json.loads(dumps(manifest_from_checkpoint(ds.path(name), hash_algorithm="sha256" if hashed else None)))
    assert sum(len(g["params"]) for g in doc["groups"]) > 0
    assert ('"state_digests"' in json.dumps(doc)) == hashed
    _same(doc)


@pytest.fixture(scope="module")
def hashed_doc(ds):
    return json.loads(dumps(manifest_from_checkpoint(ds.path("s2-bf16-ws2"), hash_algorithm="sha256")))


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p[0].update(future_field=1),  # a key no param has
        lambda p: p[1].pop("digest"),  # params that differ in their keys
        lambda p: p[0]["digest"].update(blake3="ab" * 32),  # another algorithm beside sha256
        lambda p: p[0]["state_digests"]["exp_avg"].update(blake3="ab" * 32),
        lambda p: p[0].update(digest=None),
        lambda p: p[0].update(state_digests=[]),
    ],
)
def test_params_it_does_not_build_are_left_to_validation(hashed_doc, change):
    doc = copy.deepcopy(hashed_doc)
    change(doc["groups"][0]["params"])
    assert model_build.manifest_of(doc) is None


def test_a_row_validation_refuses_is_left_to_validation(hashed_doc):
    doc = copy.deepcopy(hashed_doc)
    doc["groups"][0]["params"][0]["name"] = ""  # the schema refuses it too: never reaches here from validate
    assert model_build.manifest_of(doc) is None


def test_validate_builds_a_loaded_documents_models_in_bulk(hashed_doc, monkeypatch):
    calls = []
    real = model_build.manifest_of
    monkeypatch.setattr(model_build, "manifest_of", lambda doc: calls.append(1) or real(doc))
    report = validate_decoded(copy.deepcopy(hashed_doc), False, build_model=True)  # as the loader hands it over
    assert report.ok and calls == [1]
    assert dumps(report.manifest) == dumps(Manifest.model_validate(copy.deepcopy(hashed_doc)), reference=True)
    calls.clear()
    for other in (
        validate_decoded(copy.deepcopy(hashed_doc), False, build_model=True, reference=True),  # the reference path
        validate_document(copy.deepcopy(hashed_doc), build_model=True),  # data not from the loader
    ):
        assert other.ok and calls == []
