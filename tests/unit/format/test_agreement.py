"""The normative JSON Schema and the Pydantic models must give the same verdict.

``validate.py`` trusts the schema and reports CK002 whenever the models refuse a
document the schema accepted, so any disagreement is a ckptspec bug. Checked here:

* every conformance-corpus document (both corpora);
* hundreds of schema-level mutations of a valid manifest (the format 1.1 example, with
  every optional object), generated from the document and from the schema's own bounds
  (null, wrong type, out of range, at the limit, unknown key, missing key) - for format 1.1
  and for a newer minor version;
* generated documents: every instance of the schema is accepted by the models and
  dumps back unchanged (hypothesis-jsonschema, plus a small generator of our own);
* structure: every object of the schema has a model with the same required and
  optional fields, the same nested models and the same enumerations.

The models mirror the latest schema (1.1, a superset of 1.0); a 1.0 document is checked
against the 1.0 schema first (validate.py), which is what the corpus's verdicts test.
"""

from __future__ import annotations

import copy
import functools
import json
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from ckptspec.format import models
from ckptspec.format.codec import load_document
from ckptspec.format.integral import integral_floats
from ckptspec.format.models import Manifest
from ckptspec.format.schemas import ecma_regex
from ckptspec.format.schemas import validator as reference_validator
from ckptspec.format.tolerant import tolerant

ROOT = Path(__file__).resolve().parents[3]
SCHEMA: dict = json.loads((ROOT / "schema" / "manifest-1.1.schema.json").read_text("utf-8"))
# jsonschema with ECMA-262 pattern anchors (Python's '$' also matches before a final
# newline); otherwise exactly Draft202012Validator over the schema file.
VALIDATOR = reference_validator("manifest-1.1.schema.json")
OWN_VERSION = {v: reference_validator(f"manifest-{v}.schema.json") for v in ("1.0", "1.1")}
CORPUS = ROOT / "tests" / "conformance"
EXPECTED: dict[str, dict] = {
    f"{v}/{name}": entry
    for v in ("1.0", "1.1")
    for name, entry in json.loads((CORPUS / v / "expected.json").read_text("utf-8")).items()
}
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"


def is_newer_minor(doc: Any) -> bool:
    """The reading validate.py applies: major 1 and a minor above 1 allows unknown fields."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if not isinstance(version, str):
        return False
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 6 for p in parts):
        return False
    return int(parts[0]) == 1 and int(parts[1]) > 1


def own_schema_accepts(doc: Any) -> bool:
    """The schema of the document's own version (1.0 or 1.1; the latest for anything else)."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    line = ".".join(version.split(".")[:2]) if isinstance(version, str) else None
    check = OWN_VERSION.get(line, VALIDATOR)
    allow_unknown = is_newer_minor(doc)
    return not any(not (allow_unknown and e.validator == "additionalProperties") for e in check.iter_errors(doc))


def schema_accepts(doc: Any, allow_unknown: bool = False) -> bool:
    # as validate.schema_findings: a newer minor may carry properties this schema does not know
    return not any(
        not (allow_unknown and error.validator == "additionalProperties") for error in VALIDATOR.iter_errors(doc)
    )


def models_accept(doc: Any, allow_unknown: bool = False) -> Manifest | None:
    # As validate.py reads a document: integral floats made ints (the models are strict), and a
    # newer minor's document read by the tolerant twins.
    try:
        return (tolerant(Manifest) if allow_unknown else Manifest).model_validate(integral_floats(doc, Manifest))
    except ValidationError:
        return None


def assert_agree(doc: Any, allow_unknown: bool = False, schema_ok: bool | None = None) -> None:
    """``schema_ok``: the reference verdict when already known (``mutation_verdict``)."""
    if schema_ok is None:
        schema_ok = schema_accepts(doc, allow_unknown)
    manifest = models_accept(doc, allow_unknown)
    assert schema_ok == (manifest is not None), (
        f"schema {'accepts' if schema_ok else 'refuses'} but models {'accept' if manifest else 'refuse'}"
    )
    if manifest is not None:
        assert manifest.to_dict() == doc


# --------------------------------------------------------------------------- the corpus

CORPUS_KNOWN: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=CORPUS_KNOWN[n])) if n in CORPUS_KNOWN else n
        for n in sorted(EXPECTED)
    ],
)
def test_corpus_document(name):
    doc = load_document(CORPUS / name)
    allow_unknown = is_newer_minor(doc)
    assert_agree(doc, allow_unknown)
    codes = EXPECTED[name]["codes"]
    if "CK003" not in codes:
        # the schema-level verdict of tests/conformance/README.md: schema-valid exactly when
        # the expected codes hold no CK001 (valid files, and those only CK1xx rules reject)
        assert own_schema_accepts(doc) == ("CK001" not in codes)


# --------------------------------------------------------------------------- mutations


def base_manifest() -> dict:
    """The real ZeRO-2 example (format 1.1), plus one of every optional object/field so every schema object occurs."""
    doc = json.loads(EXAMPLE.read_text("utf-8"))
    doc["layout"]["sub_group_size"] = 1000
    doc["excluded"].append({"name": "lora.mask", "reason": "not a parameter"})
    doc["files"][1]["hash"] = {"algorithm": "sha256", "digest": "0123456789abcdef" * 4}
    doc["save"]["id"] = "5f0c8a4e-2b1d-4c3e-9a7f-1d2e3f405162"
    return doc


def _resolve(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def subschema(path: tuple) -> dict:
    """The (resolved) schema of the value at ``path`` in a manifest."""
    node = SCHEMA
    for part in path:
        node = _resolve(node)
        if isinstance(part, int):
            node = node["items"]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        else:
            node = node["additionalProperties"]
    return _resolve(node)


def objects(value: Any, path: tuple = ()):
    """Every object in the document; of each array only the first item (the others are alike)."""
    if isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            yield from objects(item, path + (key,))
    elif isinstance(value, list) and value:
        yield from objects(value[0], path + (0,))


def type_variants(value: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("null", None)]
    if isinstance(value, bool):
        out += [("int", 1), ("string", "true")]
    elif isinstance(value, int):
        out += [
            ("bool", True),
            ("string", str(value)),
            ("fraction", value + 0.5),
            ("integral-float", float(value)),
            ("negative", -1),
            ("array", [value]),
        ]
    elif isinstance(value, float):
        out += [("bool", True), ("string", str(value)), ("array", [value])]
    elif isinstance(value, str):
        out += [("int", 7), ("empty", ""), ("array", [value])]
    elif isinstance(value, list):
        out += [("object", {}), ("empty", []), ("append-null", value + [None]), ("string", "[]")]
    elif isinstance(value, dict):
        out += [("array", [value]), ("empty", {}), ("string", "{}")]
    return out


def bound_variants(schema: dict) -> list[tuple[str, Any]]:
    """Values at and just past each bound the schema declares for this value."""
    out: list[tuple[str, Any]] = []
    if "minimum" in schema:
        out += [("at-minimum", schema["minimum"]), ("below-minimum", schema["minimum"] - 1)]
    if "maximum" in schema:
        out += [("at-maximum", schema["maximum"]), ("above-maximum", schema["maximum"] + 1)]
    if schema.get("type") == "string" and "pattern" not in schema:
        if schema.get("minLength", 0) > 0:
            out.append(("below-min-length", "x" * (schema["minLength"] - 1)))
        if "maxLength" in schema:
            out += [("at-max-length", "é" * schema["maxLength"]), ("above-max-length", "é" * (schema["maxLength"] + 1))]
    if schema.get("type") == "array" and "items" in schema and schema.get("maxItems", 0) <= 64:
        out.append(("above-max-items", [1] * (schema["maxItems"] + 1)))
        out.append(("at-max-items", [1] * schema["maxItems"]))
    if "enum" in schema:
        out += [(f"enum-{v}", v) for v in schema["enum"]]
        out.append(("not-in-enum", f"not-{schema['enum'][0]}"))
    if "const" in schema:
        out.append(("not-const", schema["const"] + "!"))
    if "pattern" in schema:
        out += [("pattern-upper", "ABCDEF"), ("pattern-space", " 1.0.0"), ("pattern-empty", "")]
    return out


def _set(doc: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def _delete(doc: Any, path: tuple) -> None:
    for part in path[:-1]:
        doc = doc[part]
    del doc[path[-1]]


def _label(path: tuple) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def mutations(base: dict, full: bool) -> list[tuple[str, dict]]:
    out = []
    for path, obj in list(objects(base)):
        for key, value in obj.items():
            where = path + (key,)
            variants = [("remove", _delete)]
            if full:
                variants += type_variants(value) + bound_variants(subschema(where))
            else:
                variants += [("null", None)]
            for name, new in variants:
                doc = copy.deepcopy(base)
                if new is _delete:
                    _delete(doc, where)
                else:
                    _set(doc, where, new)
                out.append((f"{_label(where)}:{name}", doc))
        if "properties" not in subschema(path):
            continue  # a map (hyperparameters, state_digests): any key is one of its entries, not an unknown field
        doc = copy.deepcopy(base)
        target = doc
        for part in path:
            target = target[part]
        target["zz_unknown"] = "x"
        out.append((f"{_label(path)}:unknown-key", doc))
    whole = [("top-level-array", [base]), ("top-level-null", None), ("top-level-string", "{}"), ("empty-object", {})]
    return out + [(f"$:{name}", doc) for name, doc in whole]


BASE = base_manifest()
NEWER = dict(copy.deepcopy(BASE), format_version="1.4.0")
MUTATIONS_1_1 = mutations(BASE, full=True)
MUTATIONS_NEWER = mutations(NEWER, full=False)
_MUTATION = {
    **{("1.1", label): doc for label, doc in MUTATIONS_1_1},
    **{("newer", label): doc for label, doc in MUTATIONS_NEWER},
}


@functools.cache
def mutation_verdict(kind: str, label: str, allow_unknown: bool) -> bool:
    """``schema_accepts`` of the mutation ``label`` of ``kind`` ("1.1" or "newer"), computed once per
    process: pure-Python jsonschema takes about 2.5 ms a document, and ``test_enough_mutations``,
    ``test_mutation_*`` and test_fast_path.py all ask for the same verdicts."""
    return schema_accepts(_MUTATION[kind, label], allow_unknown)


def test_base_manifests_are_valid():
    assert_agree(BASE)
    assert schema_accepts(BASE) and models_accept(BASE)
    assert schema_accepts(NEWER, True) and models_accept(NEWER, True)


def test_enough_mutations():
    assert len(MUTATIONS_1_1) >= 30
    # the mutations really probe both sides: many are refused, some are accepted. Counted until both are
    # reached: each verdict is a pure-Python jsonschema run, and the worker running this test would otherwise
    # compute all of them alone (10 s) while the parametrized tests split them over the workers.
    refused = accepted = 0
    for label, _ in MUTATIONS_1_1:
        if mutation_verdict("1.1", label, False):
            accepted += 1
        else:
            refused += 1
        if refused >= 30 and accepted >= 10:
            break
    assert refused >= 30 and accepted >= 10, (refused, accepted)


@pytest.mark.parametrize("label,doc", MUTATIONS_1_1, ids=[m[0] for m in MUTATIONS_1_1])
def test_mutation_format_1_1(label, doc):
    assert_agree(doc, schema_ok=mutation_verdict("1.1", label, False))


@pytest.mark.parametrize("label,doc", MUTATIONS_NEWER, ids=[m[0] for m in MUTATIONS_NEWER])
def test_mutation_newer_minor(label, doc):
    assert_agree(doc, allow_unknown=True, schema_ok=mutation_verdict("newer", label, True))


def test_newer_minor_unknown_keys_are_accepted_by_both():
    for label, doc in MUTATIONS_NEWER:
        if label.endswith(":unknown-key"):
            assert mutation_verdict("newer", label, True) and models_accept(doc, True), label


# Found while writing these tests, now fixed: keep them as regressions.
PATTERN_NEWLINE = [
    ("format_version", ("format_version",), "1.0.0\n"),
    ("created", ("producer", "created"), "2026-11-29T20:43:00Z\n"),
    ("digest", ("files", 1, "hash", "digest"), "0123456789abcdef" * 4 + "\n"),
]
SURROGATES = [
    ("param-name", ("groups", 0, "params", 0, "name"), "emb.weight\ud800"),
    ("metadata-value", ("producer", "metadata", "model"), "\udc00"),
    ("metadata-key", ("producer", "metadata", "\ud800"), "x"),
    ("file-path", ("files", 0, "path"), "a\ud800.pt"),
]


@pytest.mark.parametrize("where,value", [pytest.param(p, v, id=label) for label, p, v in PATTERN_NEWLINE])
def test_pattern_anchors_are_ecma(where, value):
    """JSON Schema patterns are ECMA-262: '$' does not match before a final newline."""
    doc = copy.deepcopy(BASE)
    _set(doc, where, value)
    assert not schema_accepts(doc)
    assert_agree(doc)


@pytest.mark.parametrize("where,value", [pytest.param(p, v, id=label) for label, p, v in SURROGATES])
def test_lone_surrogates_are_refused_by_the_loader(where, value):
    """A lone surrogate escape is not Unicode text: the loader refuses the document (CK903)."""
    from ckptspec.errors import CkptspecError
    from ckptspec.format.codec import decode

    doc = copy.deepcopy(BASE)
    _set(doc, where, value)
    with pytest.raises(CkptspecError) as info:
        decode(json.dumps(doc).encode("utf-8"), "json")
    assert info.value.code == "CK903"


def test_newer_minor_unknown_null_field_is_kept():
    doc = copy.deepcopy(NEWER)
    doc["layout"]["future_option"] = None
    assert_agree(doc, allow_unknown=True)


# --------------------------------------------------------------------------- generated documents


def bounded_schema(max_items: int = 2, max_length: int = 8) -> dict:
    """A copy of the schema with small upper bounds on sizes.

    Tightening only upper bounds (maxItems, maxProperties, maxLength) gives a subset of the
    real schema's instances, so every generated document must still be valid against the
    real schema (asserted). Without it the generators would try million-item arrays and
    65536-char strings. maxLength is left alone where a pattern decides the length
    (``created``: 20+ characters).
    """

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: walk(v) for k, v in node.items()}
            for key in ("maxItems", "maxProperties"):
                if key in node:
                    node[key] = min(node[key], max_items)
            if "maxLength" in node and "pattern" not in node:
                node["maxLength"] = min(node["maxLength"], max_length)
            if isinstance(node.get("pattern"), str):  # the generators read Python's '$', which allows a final
                node["pattern"] = ecma_regex(node["pattern"]).pattern  # newline; the schema's ECMA '$' does not
            return node
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(SCHEMA)


def strict_json(doc: Any) -> str:
    """Type-exact comparison: 1, 1.0 and true differ in JSON text, not in Python ==."""
    return json.dumps(doc, sort_keys=True, ensure_ascii=False)


def check_generated(doc: dict) -> None:
    assert VALIDATOR.is_valid(doc), "generator produced a document the real schema refuses"
    manifest = models_accept(doc)
    assert manifest is not None, "schema-valid document refused by the models"
    assert strict_json(manifest.to_dict()) == strict_json(doc)


def _hypothesis_jsonschema_works() -> bool:
    # hypothesis-jsonschema 0.23.1 (the latest) drives hypothesis' private `many` helper with
    # `.more()`, which hypothesis 6.170.10 removed: every object draw then raises AttributeError.
    from hypothesis.internal.conjecture import utils as cu

    return hasattr(cu.many, "more")


def build_strategies_once(monkeypatch) -> None:
    """Make hypothesis-jsonschema build the strategy of each subschema once, not on every draw.

    For every key of every object it draws, ``from_object_schema`` calls ``merged_as_strategies``
    or ``__from_schema`` on that key's subschema, which resolves, canonicalises and merges it
    again: 0.2 s a manifest, most of this test's time. Both are functions of their arguments
    (a schema, and the alphabet and formats of this ``from_schema`` call), and a strategy is a
    description: an equal one draws the same values from the same choices, so the documents
    generated are the same (checked: same seed, same documents with and without this).
    """
    from hypothesis_jsonschema import _from_schema as module

    def once(build):
        built: dict = {}

        def cached(schema, *, alphabet, custom_formats):
            key = (json.dumps(schema, sort_keys=True), id(alphabet), id(custom_formats))
            if key not in built:
                built[key] = (build(schema, alphabet=alphabet, custom_formats=custom_formats), alphabet, custom_formats)
            return built[key][0]

        return cached

    for name in ("merged_as_strategies", "__from_schema"):
        monkeypatch.setattr(module, name, once(getattr(module, name)))


def test_hypothesis_jsonschema_documents_round_trip(monkeypatch):
    # hypothesis is pinned below 6.170.10 in pyproject.toml for this test.
    assert _hypothesis_jsonschema_works(), "hypothesis-jsonschema needs hypothesis<6.170.10"
    from hypothesis_jsonschema import from_schema

    build_strategies_once(monkeypatch)

    # Drawing a manifest still costs a few ms a subschema (hypothesis-jsonschema's objects go
    # through private hypothesis internals), so the example budget stays at 40.
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(from_schema(bounded_schema()))
    def run(doc):
        check_generated(doc)

    run()


# A small generator for exactly the JSON Schema vocabulary the manifest schema uses; a
# keyword it does not know fails loudly, so a future schema cannot be half-generated.
_KNOWN_KEYWORDS = {
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "$ref",
    "title",
    "type",
    "properties",
    "required",
    "additionalProperties",
    "propertyNames",
    "maxProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "enum",
    "const",
    "anyOf",
    "minProperties",
}


def schema_strategy(node: dict) -> st.SearchStrategy:
    unknown = set(node) - _KNOWN_KEYWORDS
    assert not unknown, f"schema keywords this generator does not handle: {unknown}"
    if "$ref" in node:
        return schema_strategy(_resolve(node))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "anyOf" in node:
        return st.one_of([schema_strategy(option) for option in node["anyOf"]])
    kind = node["type"]
    if kind == "object":
        if "properties" in node:
            required = set(node.get("required", []))
            props = {k: schema_strategy(v) for k, v in node["properties"].items()}
            objects = st.fixed_dictionaries(
                {k: s for k, s in props.items() if k in required},
                optional={k: s for k, s in props.items() if k not in required},
            )
            return objects.filter(lambda d: len(d) >= node.get("minProperties", 0))
        keys = schema_strategy({"type": "string", **node.get("propertyNames", {})})
        return st.dictionaries(keys, schema_strategy(node["additionalProperties"]), max_size=node.get("maxProperties"))
    if kind == "array":
        return st.lists(schema_strategy(node["items"]), min_size=node.get("minItems", 0), max_size=node.get("maxItems"))
    if kind == "string":
        lo, hi = node.get("minLength", 0), node.get("maxLength")
        if "pattern" in node:
            # fullmatch: never the trailing newline a bare `$` would allow in Python
            text = st.from_regex(node["pattern"], fullmatch=True)
            return text.filter(lambda s: lo <= len(s) <= (hi if hi is not None else len(s)))
        return st.text(min_size=lo, max_size=hi)
    if kind == "integer":
        return st.integers(min_value=node.get("minimum"), max_value=node.get("maximum"))
    if kind == "number":
        return st.floats(min_value=node.get("minimum"), allow_nan=False, allow_infinity=False) | st.integers(
            min_value=node.get("minimum")
        )
    if kind == "boolean":
        return st.booleans()
    raise AssertionError(f"unhandled schema node {node}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema_strategy(bounded_schema()))
def test_own_generator_documents_round_trip(doc):
    check_generated(doc)


# --------------------------------------------------------------------------- structure

MODEL_FOR_DEF: dict[str, type[BaseModel]] = {
    "producer": models.Producer,
    "layout": models.Layout,
    "group": models.Group,
    "param": models.Param,
    "frozen_param": models.FrozenParam,
    "buffer": models.Buffer,
    "alias": models.Alias,
    "excluded_param": models.ExcludedParam,
    "hash": models.Hash,
    "shard_file": models.ShardFile,
    "locator": models.Locator,
    "tensor_locator": models.TensorLocator,
    "model_weights_locator": models.ModelWeightsLocator,
    "state_locator": models.StateLocator,
    "digest": models.Digest,
    "optimizer": models.Optimizer,
    "optimizer_group": models.OptimizerGroup,
    "loss_scaler": models.LossScaler,
    "save": models.Save,
}


def _object_schemas() -> list[tuple[str, dict, type[BaseModel]]]:
    out = [("(root)", SCHEMA, Manifest)]
    for name, node in SCHEMA["$defs"].items():
        if node.get("type") == "object" and "properties" in node:  # not maps such as "values"
            assert name in MODEL_FOR_DEF, f"$defs/{name} is an object without a model mapping"
            out.append((name, node, MODEL_FOR_DEF[name]))
    return out


def _nested_models(annotation: Any) -> set[type]:
    found = set()
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.add(annotation)
    for arg in typing.get_args(annotation):
        found |= _nested_models(arg)
    return found


def _literals(annotation: Any) -> set | None:
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        values = _literals(arg)
        if values is not None:
            return values
    return None


def _def_name(node: dict) -> str | None:
    return node["$ref"].rsplit("/", 1)[1] if "$ref" in node else None


@pytest.mark.parametrize("name,node,model", _object_schemas(), ids=[o[0] for o in _object_schemas()])
def test_object_fields_agree(name, node, model):
    fields = {f.alias or k: f for k, f in model.model_fields.items()}  # Optimizer's "class" is the field class_
    assert set(node["properties"]) == set(fields)
    required = set(node.get("required", []))
    if node.get("minProperties") == 1 and len(node["properties"]) == 1:
        required |= set(node["properties"])  # "at least one of one" (a digest): that one is required
    assert required == {k for k, f in fields.items() if f.is_required()}
    assert node.get("additionalProperties") is False
    for prop, prop_schema in node["properties"].items():
        annotation = fields[prop].annotation
        # nested objects: same model as the schema's $defs object (directly, as array items or as map values)
        target = (
            _def_name(prop_schema)
            or _def_name(prop_schema.get("items", {}))
            or _def_name(prop_schema.get("additionalProperties") or {})
        )
        expected_models = {MODEL_FOR_DEF[target]} if target in MODEL_FOR_DEF else set()
        assert _nested_models(annotation) == expected_models, prop
        # enumerations and constants: the same values as the Literal
        resolved = _resolve(prop_schema)
        if "enum" in resolved:
            assert _literals(annotation) == set(resolved["enum"]), prop
        if "const" in resolved:
            assert _literals(annotation) == {resolved["const"]}, prop
