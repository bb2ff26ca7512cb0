"""The checkpoint index document (schema/checkpoint-1.0.schema.json, -1.1): schema, models and the CK6xx rules.

The fixtures in tests/conformance/index-1.0/ are the indexes of three real harness checkpoints
(AutoTP tp2 x dp2 ZeRO-2 bf16, pipeline pp2 x dp2 ZeRO-1 fp32, ZeRO stage 0 bf16 with FP16_Optimizer
and buffers; ``ckptspec generate``), accepted by the reference JSON Schema validator on its own; those in
index-1.1/ the 1.1 indexes of two with frozen parameters, buffers and a tie (``scenarios.EXTRAS``: AutoTP
tp2 ZeRO-1 fp32, pipeline pp2 ZeRO-1 fp32 with a ``TiedLayerSpec``). Each rule is shown by one named edit
of one of them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from ckptspec.format.index_models import CheckpointIndex
from ckptspec.format.index_rules import INDEX_RULES
from ckptspec.format.index_validate import is_index, validate_index_document
from ckptspec.format.validate import validate_document

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "conformance" / "index-1.0"
FIXTURES_1_1 = ROOT / "tests" / "conformance" / "index-1.1"
SCHEMAS = {
    v: Draft202012Validator(json.loads((ROOT / "schema" / f"checkpoint-{v}.schema.json").read_text()))
    for v in ("1.0", "1.1")
}
SCHEMA = SCHEMAS["1.0"]
TP, PP, S0 = "tp2dp2-s2-bf16-ws4.json", "pp2dp2-s1-fp32-ws4.json", "s0-bf16-ws2-fused.json"
TPX, PPX = "tp2-s1-fp32-ws2-extras.json", "pp2-s1-fp32-ws2-extras.json"  # index 1.1: extras, aliases


def _load(name: str) -> dict:
    return json.loads(((FIXTURES_1_1 if name in (TPX, PPX) else FIXTURES) / name).read_text())


def _schema(doc: dict) -> Draft202012Validator:
    return SCHEMAS[".".join(doc["format_version"].split(".")[:2])]


@pytest.mark.parametrize("name", [TP, PP, S0, TPX, PPX])
def test_fixtures_are_valid_indexes(name):
    doc = _load(name)
    assert list(_schema(doc).iter_errors(doc)) == []
    report = validate_index_document(doc)
    assert report.findings == [] and report.index is not None
    assert report.index.to_dict() == doc  # the models keep the document as it is
    assert is_index(doc)


def test_a_manifest_reader_refuses_an_index():
    """A 1.x reader handed an index refuses it at once (CK001 on ``format``), never half-reads it."""
    findings = validate_document(_load(TP)).findings
    assert findings and findings[0].code == "CK001" and findings[0].path == "$"


def _set(path, value):
    def edit(doc):
        *parents, last = path
        node = doc
        for key in parents:
            node = node[key]
        node[last] = value

    return edit


def _swap_split(doc):  # rank 1's block of up.weight moved onto rank 0's: a gap and an overlap
    doc["parameters"][0]["shards"][1]["placement"]["split"]["offset"] = 0


def _axes_disagree(doc):  # rank 1's block of up.weight split along the other axis (was: CK999, a TypeError)
    doc["parameters"][0]["shards"][1]["placement"]["split"]["axis"] = 1


def _two_primaries(doc):
    p = next(p for p in doc["parameters"] if p["shards"][0]["placement"] == "replicated")
    for s in p["shards"]:
        s["primary"] = True


def _unclaimed(doc):
    del doc["parameters"][0]


def _claimed_twice(doc):
    doc["parameters"][1]["shards"][0]["local_name"] = doc["parameters"][0]["shards"][0]["local_name"]
    doc["parameters"][1]["shards"][0]["local_shape"] = doc["parameters"][0]["shards"][0]["local_shape"]


def _rank_mismatch(doc):
    files = doc["domains"][1]["file_ranks"]
    name = next(n for n in files if "zero_pp_rank_1_" in n)
    files[name] = 0


def _layer_of_other_stage(doc):
    doc["layer_files"][3]["pipeline"] = 0  # layer 3 belongs to stage 1


def _split_from_nowhere(doc):
    doc["parameters"][0]["placement_source"] = "none"


def _weights_as_masters(doc):
    """What an earlier ckptspec wrote for a stage-0 FP16_Optimizer checkpoint: the bf16 weights as masters."""
    for loc in doc["domains"][0]["masters"]["tensors"]:
        loc.update(key=["module", loc["param"]], dtype="bfloat16")


def _missing_domain(doc):
    del doc["domains"][1]
    for p in doc["parameters"]:
        p["shards"] = [s for s in p["shards"] if s["domain"] != "pp0-tp1"]
    for p in doc["parameters"]:
        if p["shards"][0]["placement"] == "replicated":
            p["shards"][0]["primary"] = True


RULE_CASES = [
    # (name, fixture, edit, code, path of the first finding of that code)
    ("mp-size", TP, _set(("topology", "model_parallel_size"), 4), "CK602", "$.topology.model_parallel_size"),
    (
        "coordinate-outside",
        PP,
        _set(("domains", 1, "coordinate", "pipeline"), 2),
        "CK602",
        "$.domains[1].coordinate.pipeline",
    ),
    ("missing-tp-rank", TP, _missing_domain, "CK602", "$.domains"),
    ("size-vs-world", TP, _set(("domains", 0, "size"), 4), "CK603", "$.domains[0].size"),
    (
        "file-rank",
        TP,
        _rank_mismatch,
        "CK603",
        "$.domains[1].file_ranks['bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt']",
    ),
    (
        "shared-file-size",
        PP,
        lambda d: d["domains"][1]["manifest"]["files"].append({**d["domains"][0]["manifest"]["files"][0], "size": 1}),
        "CK604",
        "$.domains[1].manifest.files[3]",
    ),
    ("split-overlap", TP, _swap_split, "CK605", "$.parameters[0].shards"),
    ("two-primaries", TP, _two_primaries, "CK605", "$.parameters[3].shards"),
    ("split-axes-disagree", TP, _axes_disagree, "CK605", "$.parameters[0].shards"),
    ("unclaimed", TP, _unclaimed, "CK606", "$.domains[0].manifest.groups"),
    ("claimed-twice", PP, _claimed_twice, "CK606", "$.parameters[1].shards[0]"),
    ("layer-of-other-stage", PP, _layer_of_other_stage, "CK607", "$.layer_files[3].tensors['down.bias']"),
    ("layer-file-unlisted", PP, lambda d: d["layer_files"].pop(3), "CK607", "$.parameters"),
    ("split-from-nowhere", TP, _split_from_nowhere, "CK608", "$.parameters[0].placement_source"),
    ("weights-as-masters", S0, _weights_as_masters, "CK609", "$.domains[0].masters.tensors[0]"),
    # index 1.1: the extras' shards and placements, the ties
    (
        "extra-split-overlap",
        TPX,
        _set(("extras", 0, "shards", 1, "placement", "split", "offset"), 0),
        "CK605",
        "$.extras[0].shards",
    ),
    (
        "extra-no-such-buffer",
        TPX,
        _set(("extras", 2, "shards", 0, "local_name"), "runnin"),
        "CK610",
        "$.extras[2].shards[0]",
    ),
    ("extra-role-swapped", TPX, _set(("extras", 3, "role"), "frozen"), "CK610", "$.extras[3].shards[0]"),
    ("extra-dropped", TPX, lambda d: d["extras"].pop(1), "CK610", "$.domains[0].manifest.frozen"),
    ("extra-is-a-parameter", TPX, _set(("extras", 1, "name"), "head.weight"), "CK610", "$.extras[1].name"),
    ("locator-numel", PPX, _set(("extras", 0, "shards", 0, "locator", "numel"), 511), "CK610", "$.extras[0].shards[0]"),
    (
        "locator-past-member",
        PPX,
        _set(("extras", 0, "shards", 0, "locator", "element_offset"), 1),
        "CK610",
        "$.extras[0].shards[0]",
    ),
    (
        "locator-other-stage",
        PPX,
        _set(("extras", 0, "shards", 0, "domain"), "pp1-tp0"),
        "CK610",
        "$.extras[0].shards[0]",
    ),
    ("tie-to-nothing", PPX, _set(("aliases", "4.weight"), "0.bias"), "CK610", "$.aliases['4.weight']"),
    ("tie-is-a-tensor", PPX, _set(("aliases", "5.bias"), "0.weight"), "CK610", "$.aliases['5.bias']"),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c[0])
def test_each_rule_refuses_its_edit(case):
    _, fixture, edit, code, path = case
    doc = _load(fixture)
    edit(doc)
    assert list(_schema(doc).iter_errors(doc)) == []  # the schema cannot see it: the rule must
    report = validate_index_document(doc)
    hits = [f for f in report.findings if f.code == code]
    assert hits, [f.to_line() for f in report.findings]
    assert hits[0].path == path, [f.to_line() for f in hits]
    assert not report.ok


def test_every_rule_has_a_case():
    assert {r.code for r in INDEX_RULES} == {c[3] for c in RULE_CASES}


def test_a_domain_manifest_is_checked_as_a_manifest():
    """Its own 1.x findings, with their codes, at paths inside the index."""
    doc = _load(TP)
    doc["domains"][1]["manifest"]["groups"][0]["params"][0]["numel"] += 1
    codes = {(f.code, f.path) for f in validate_index_document(doc).findings}
    assert ("CK101", "$.domains[1].manifest.groups[0].params[0].numel") in codes


SCHEMA_CASES = [
    ("unknown-top-level-field", _set(("extra",), 1)),
    ("placement-kind", _set(("parameters", 0, "shards", 0, "placement"), "diagonal")),
    ("split-without-axis", _set(("parameters", 0, "shards", 0, "placement"), {"split": {"offset": 0, "length": 16}})),
    ("kind", _set(("kind",), "megatron")),
    ("degree-zero", _set(("topology", "degrees", "tensor"), 0)),
    ("no-domains", _set(("domains",), [])),
    ("domain-rank-negative", _set(("domains", 0, "file_ranks", "mp_rank_00_model_states.pt"), -1)),
]


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=lambda c: c[0])
def test_schema_and_models_agree(case):
    """What the schema refuses (CK001) the models refuse too, and the other way round."""
    from pydantic import ValidationError

    doc = _load(TP)
    case[1](doc)
    schema_ok = not list(SCHEMA.iter_errors(doc))
    try:
        CheckpointIndex.model_validate(copy.deepcopy(doc))
        model_ok = True
    except ValidationError:
        model_ok = False
    assert schema_ok == model_ok is False
    assert validate_index_document(doc).findings[0].code == "CK001"


def test_versions():
    doc = _load(PP)
    doc["format_version"] = "2.0.0"
    assert [f.code for f in validate_index_document(doc).findings] == ["CK003"]
    doc["format_version"] = "1.3.0"
    doc["future_field"] = {"x": 1}
    report = validate_index_document(doc)
    assert [f.code for f in report.findings] == ["CK004"] and report.ok


SCHEMA_CASES_1_1 = [
    ("extra-role-trainable", _set(("extras", 0, "role"), "trainable")),
    ("extra-without-shards", _set(("extras", 0, "shards"), [])),
    ("extra-placement-source", _set(("extras", 0, "placement_source"), "none")),
    ("alias-owner-not-a-name", _set(("aliases", "4.weight"), 4)),
    ("locator-without-numel", lambda d: d["extras"][0]["shards"][0]["locator"].pop("numel")),
    ("locator-unknown-field", _set(("extras", 0, "shards", 0, "locator", "file"), "layer_02-model_states.pt")),
    ("parameter-role-frozen", _set(("parameters", 0, "role"), "frozen")),
]


@pytest.mark.parametrize("case", SCHEMA_CASES_1_1, ids=lambda c: c[0])
def test_schema_1_1_and_models_agree(case):
    """Index 1.1's new fields: what its schema refuses the models refuse too (CK001 first)."""
    from pydantic import ValidationError

    doc = _load(PPX)
    case[1](doc)
    assert list(SCHEMAS["1.1"].iter_errors(doc))
    with pytest.raises(ValidationError):
        CheckpointIndex.model_validate(copy.deepcopy(doc))
    assert validate_index_document(doc).findings[0].code == "CK001"


def test_a_1_0_index_may_not_carry_1_1_fields():
    """Each document is checked against its own version's schema: extras in a 1.0 index are CK001 (the
    models, which mirror the latest schema, would take them)."""
    doc = _load(PPX)
    doc["format_version"] = "1.0.0"
    assert [(f.code, f.path) for f in validate_index_document(doc).findings] == [("CK001", "$")]
    del doc["extras"], doc["aliases"]
    assert validate_index_document(doc).ok


def test_the_1_1_schema_objects_are_the_models():
    """Structure: index 1.1's new objects have the models' fields, required fields and enumerations."""
    import typing

    from ckptspec.format import index_models

    defs = json.loads((ROOT / "schema" / "checkpoint-1.1.schema.json").read_text())
    pairs = {
        "extra": index_models.IndexExtra,
        "shard": index_models.Shard,
        "shard_locator": index_models.ShardLocator,
        "parameter": index_models.IndexParameter,
    }
    for name, model in [*pairs.items(), ("(document)", CheckpointIndex)]:
        node = defs if name == "(document)" else defs["$defs"][name]
        assert set(node["properties"]) == set(model.model_fields), name
        assert set(node["required"]) == {k for k, f in model.model_fields.items() if f.is_required()}, name
        for prop in ("role", "placement_source"):
            if prop in node["properties"]:
                literal = typing.get_args(model.model_fields[prop].annotation)
                assert set(node["properties"][prop]["enum"]) == set(literal), (name, prop)
