"""The fast validation path and the reference path give the same verdict.

``validate.py`` first asks a compiled validator (jsonschema-rs) whether the document
is schema-valid, then runs the semantic rules on the decoded document without building
the models. The reference path is ``jsonschema`` plus the Pydantic models. Checked here:

* every conformance-corpus file, JSON and msgpack: identical findings (code, path,
  message, hint), read from the file and as already-decoded data;
* the compiled validator's verdict equals ``jsonschema``'s on every corpus file, on
  hundreds of mutations of a valid manifest (format 1.1 and a newer minor) and on
  generated documents;
* data the compiled validator cannot take (integers past 64 bits, lone surrogates,
  integral floats) and a machine without jsonschema-rs fall back to the reference;
* checkpoint indexes take the same fast path (``index_validate.py``): on every file of the index
  corpora and on mutations of a valid index, the compiled verdict is the reference's (a refused index
  then gets the reference's findings, which test_index_conformance.py holds to the corpus), and a valid
  index never waits for the reference.
"""

from __future__ import annotations

import copy
import functools
import json
import operator
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from test_agreement import (
    BASE,
    MUTATIONS_1_1,
    MUTATIONS_NEWER,
    _set,
    bounded_schema,
    mutation_verdict,
    schema_strategy,
)

from ckptspec.format import schemas as schemas_registry
from ckptspec.format.codec import decode_document, load_document
from ckptspec.format.documents import validate_file
from ckptspec.format.index_validate import validate_index_document
from ckptspec.format.validate import fast_schema_accepts, validate_document

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "conformance"
CORPUS_FILES = sorted(p for p in CORPUS.glob("1.*/*/*") if p.suffix in (".json", ".msgpack"))
INDEX_FILES = sorted(CORPUS.glob("checkpoint-1.*/*/*.json"))
VALID_INDEX = "tp2-s1-fp32-ws2-extras.json"  # AutoTP: split and replicated placements, several domains


def lines(report) -> list[dict]:
    return [f.to_dict() for f in report.findings]


def test_the_compiled_validator_is_installed():
    # It is a dependency: without it every document takes the slow reference path.
    assert schemas_registry.fast_validator("manifest-1.0.schema.json") is not None
    assert schemas_registry.fast_validator("manifest-1.1.schema.json") is not None


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_corpus_file_same_findings_on_both_paths(path):
    fast = validate_file(path, build_model=False)
    reference = validate_file(path, reference=True)
    assert lines(fast) == lines(reference)
    assert fast.ok == reference.ok
    # As decoded data through the public API (models built): the same findings again.
    assert lines(validate_document(load_document(path))) == lines(reference)


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_corpus_file_compiled_verdict_is_the_reference_verdict(path):
    doc = load_document(path)
    # Both against the schema of the document's own version (a 1.0 document may not carry 1.1's fields).
    own = schemas_registry.validator(schemas_registry.manifest_schema_file(schemas_registry.schema_version_of(doc)))
    assert fast_schema_accepts(doc) == own.is_valid(doc)


def test_the_corpus_exercises_both_verdicts():
    verdicts = {fast_schema_accepts(load_document(p)) for p in CORPUS_FILES}
    assert verdicts == {True, False}


@pytest.mark.parametrize(
    "kind,label,doc",
    [("1.1", *m) for m in MUTATIONS_1_1] + [("newer", *m) for m in MUTATIONS_NEWER],
    ids=[m[0] for m in MUTATIONS_1_1] + [f"newer-{m[0]}" for m in MUTATIONS_NEWER],
)
def test_mutation_compiled_verdict_is_the_reference_verdict(kind, label, doc):
    accepted = fast_schema_accepts(doc)
    # the 1.1 schema's reference verdict, unknown fields not tolerated (VALIDATOR.is_valid), shared
    # with test_agreement.py: computed once per process
    assert accepted == mutation_verdict(kind, label, False)
    if accepted:  # a refused document takes the reference path on both sides: nothing more to compare
        assert lines(validate_document(doc, build_model=False)) == lines(validate_document(doc, reference=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema_strategy(bounded_schema()))
def test_generated_documents_same_findings_on_both_paths(doc):
    doc["format_version"] = "1.1.0"  # generated from the 1.1 schema: a document of that version
    assert fast_schema_accepts(doc)
    assert lines(validate_document(doc, build_model=False)) == lines(validate_document(doc, reference=True))


@pytest.mark.parametrize(
    "where,value",
    [
        (("groups", 0, "params", 0, "numel"), 2**70),  # past 64 bits
        (("groups", 0, "params", 0, "name"), "emb\ud800"),  # lone surrogate (data not from the loader)
        (("producer", "metadata"), {"k": "\udc00"}),
    ],
)
def test_data_the_compiled_validator_cannot_take_goes_to_the_reference(where, value):
    doc = copy.deepcopy(BASE)
    _set(doc, where, value)
    reference = validate_document(doc, reference=True)
    assert not reference.ok
    assert lines(validate_document(doc)) == lines(reference)
    assert lines(validate_document(doc, build_model=False)) == lines(reference)


def _with_integral_floats(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["layout"]["world_size"] = float(doc["layout"]["world_size"])
    doc["groups"][0]["params"][1]["offset"] = float(doc["groups"][0]["params"][1]["offset"] + 1)  # breaks CK106
    return doc


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_integral_floats_are_read_like_integers(tmp_path, encoding):
    doc = _with_integral_floats(BASE)
    path = tmp_path / f"m.{encoding}"
    path.write_bytes(json.dumps(doc).encode() if encoding == "json" else msgpack.packb(doc))
    decoded, floats = decode_document(path.read_bytes(), encoding)
    assert floats and decoded == doc  # noticed, and decoding stayed lossless
    reference = validate_file(path, reference=True)
    assert {f.code for f in reference.findings} == {"CK106"}
    assert reference.findings[0].path == "$.groups[0].params[1].offset"
    assert ".0" not in reference.findings[0].message  # read as integers
    assert lines(validate_file(path, build_model=False)) == lines(reference)


def test_without_the_compiled_validator_the_reference_decides(monkeypatch):
    bad = copy.deepcopy(BASE)
    bad["layout"]["world_size"] = "2"
    monkeypatch.setattr(schemas_registry, "fast_validator", lambda filename: None)
    assert not fast_schema_accepts(BASE)
    assert validate_document(BASE, build_model=False).ok
    assert [f.code for f in validate_document(bad).findings] == ["CK001"]


OPTIMIZER_FLOATS = CORPUS / "1.1" / "valid" / "deepspeed-zero2-bf16-2ranks.json"


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize(
    "where",
    [
        None,
        ("optimizer", "groups", 0, "optimizer_group"),  # an integer inside the optimizer section
        ("groups", 0, "params", 0, "offset"),
        ("layout", "world_size"),
    ],
)
def test_only_floats_outside_the_optimizer_settings_need_the_models(tmp_path, encoding, where):
    """A real manifest's optimizer settings hold floats (lr 0.01, betas, eps, step 2.0, clip_grad,
    the loss scale): numbers the schema takes as they are, so the rules read the decoded document
    (0.4 s instead of 3 s at 100k tensors). A float where the schema has an integer still goes
    through the models, and both paths give the reference's findings."""
    doc = json.loads(OPTIMIZER_FLOATS.read_text())
    assert doc["optimizer"]["groups"][0]["hyperparameters"]["lr"] == 0.01
    if where is not None:
        _set(doc, where, float(functools.reduce(operator.getitem, where, doc)))
    path = tmp_path / f"m.{encoding}"
    path.write_bytes(json.dumps(doc).encode() if encoding == "json" else msgpack.packb(doc))
    decoded, floats = decode_document(path.read_bytes(), encoding)
    assert decoded == doc and floats == (where is not None)
    reference = validate_file(path, reference=True)
    assert reference.ok
    assert lines(validate_file(path)) == lines(reference)
    assert lines(validate_file(path, build_model=False)) == lines(reference)


def _index_schema_file(doc: dict) -> str:
    own = ".".join(str(doc["format_version"]).split(".")[:2])
    return schemas_registry.INDEX_SCHEMAS.get(own, schemas_registry.INDEX_SCHEMAS[schemas_registry.LATEST_INDEX])


def _index_mutations() -> list[tuple[str, dict]]:
    """A valid 1.1 index broken (or not) one field at a time, where the schema draws its lines."""
    base = load_document(CORPUS / "checkpoint-1.1" / "valid" / VALID_INDEX)
    edits = {
        "degree-zero": (("topology", "degrees", "tensor"), 0),
        "degree-string": (("topology", "degrees", "tensor"), "2"),
        "unknown-top-field": (("surprise",), 1),
        "domain-id-empty": (("domains", 0, "id"), ""),
        "domain-size-float": (("domains", 0, "size"), 2.0),
        "param-name-number": (("parameters", 0, "name"), 7),
        "param-shape-negative": (("parameters", 0, "shape"), [-1]),
        "param-shape-huge": (("parameters", 0, "shape"), [2**70]),
        "lone-surrogate": (("parameters", 0, "name"), "w\ud800"),
        "domain-manifest-not-object": (("domains", 0, "manifest"), []),
    }
    out = [("as-is", base)]
    for label, (where, value) in edits.items():
        doc = copy.deepcopy(base)
        _set(doc, where, value)
        out.append((label, doc))
    return out


def test_the_compiled_index_validators_are_installed():
    assert all(schemas_registry.fast_validator(f) is not None for f in schemas_registry.INDEX_SCHEMAS.values())


@pytest.mark.parametrize("path", INDEX_FILES, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_index_compiled_verdict_is_the_reference_verdict(path):
    doc = load_document(path)
    filename = _index_schema_file(doc)
    assert schemas_registry.fast_accepts(filename, doc) == schemas_registry.validator(filename).is_valid(doc)


@pytest.mark.parametrize("label,doc", _index_mutations(), ids=lambda v: v if isinstance(v, str) else "")
def test_index_mutation_compiled_verdict_is_the_reference_verdict(label, doc):
    filename = _index_schema_file(doc)
    try:
        reference = schemas_registry.validator(filename).is_valid(doc)
    except RecursionError:  # pragma: no cover - not among these mutations
        reference = False
    assert schemas_registry.fast_accepts(filename, doc) == reference, label


def test_the_index_corpus_exercises_both_verdicts():
    verdicts = set()
    for path in INDEX_FILES:
        doc = load_document(path)
        verdicts.add(schemas_registry.fast_accepts(_index_schema_file(doc), doc))
    assert verdicts == {True, False}


def test_a_valid_index_never_takes_the_reference_path(monkeypatch):
    """The point of the fast path: the reference validator (23 ms an index) runs only for a refused document."""
    from ckptspec.format import index_validate

    def reference(*args, **kwargs):
        raise AssertionError("the reference validator ran on a valid index")

    monkeypatch.setattr(index_validate, "schema_findings", reference)
    report = validate_index_document(load_document(CORPUS / "checkpoint-1.1" / "valid" / VALID_INDEX))
    assert report.ok and report.index is not None
