"""The torch DCP document (``ckptspec.dcp`` 1.0, docs/spec-dcp.md): its corpus (tests/conformance/dcp-1.0, by
make_dcp_corpus.py from two documents ``ckptspec generate`` wrote for real FSDP2 saves), its schema and models.

Every file is validated in-process and through the CLI: the verdict, exit code, error and warning codes and the JSON
paths of the errors are those of ``expected.json``. The models mirror the schema: the same objects, fields, required
fields and enumerations, and the same verdict on every corpus file and on each mutation below.
tests/interop/test_node_reader_dcp.py holds the Node reader to the same verdicts.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import BaseModel, ValidationError

from ckptspec.cli import cli
from ckptspec.errors import InvalidManifest, MigrationError
from ckptspec.format import dcp_models
from ckptspec.format.codec import load_document
from ckptspec.format.dcp_models import DcpDocument
from ckptspec.format.dcp_rules import DCP_RULES
from ckptspec.format.dcp_validate import validate_dcp_document
from ckptspec.format.documents import load, load_manifest, migrate, validate_document, validate_file
from ckptspec.format.schemas import DCP_SCHEMAS, SCHEMAS_BY_KIND, validator

ROOT = Path(__file__).resolve().parents[3]
CONFORMANCE = ROOT / "tests" / "conformance"
CORPUS = CONFORMANCE / "dcp-1.0"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text("utf-8"))
FILES = sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.glob("*/*.json"))
VALID = [n for n in FILES if EXPECTED[n]["valid"]]
SCHEMA = validator(DCP_SCHEMAS["1.0"])
SCHEMA_DOC = json.loads((ROOT / "schema" / "dcp-1.0.schema.json").read_text("utf-8"))


def _errors(report) -> tuple[set[str], set[str], set[str]]:
    errors = [f for f in report.findings if f.severity == "error"]
    warnings = {f.code for f in report.findings if f.severity == "warning"}
    return {f.code for f in errors}, warnings, {f.path for f in errors}


def test_corpus_is_reproducible(capsys):
    spec = importlib.util.spec_from_file_location("_make_dcp_corpus", CONFORMANCE / "make_dcp_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def test_expected_lists_exactly_the_corpus_files():
    assert set(EXPECTED) == set(FILES)
    assert len(VALID) >= 5 and len(FILES) - len(VALID) >= 18


@pytest.mark.parametrize("name", FILES)
def test_entry_is_well_formed(name):
    entry = EXPECTED[name]
    assert entry["valid"] == (not entry["codes"]) == (name.split("/")[0] == "valid") == (not entry["paths"])
    if not entry["valid"]:
        assert Path(name).name[:5] in entry["codes"]  # named for the rule it breaks


def test_every_code_is_covered():
    covered = {code for e in EXPECTED.values() for code in e["codes"] + e["warnings"]}
    assert {r.code for r in DCP_RULES} | {"CK001", "CK003", "CK004"} <= covered


@pytest.mark.parametrize("name", FILES)
def test_validate_file(name):
    entry = EXPECTED[name]
    report = validate_file(CORPUS / name)
    assert _errors(report) == (set(entry["codes"]), set(entry["warnings"]), set(entry["paths"]))
    assert report.ok == entry["valid"]
    assert all(f.message and f.hint for f in report.findings)
    if entry["valid"]:
        assert isinstance(report.manifest, DcpDocument) and report.manifest.to_dict() == load_document(CORPUS / name)


@pytest.mark.parametrize("name", FILES)
def test_cli_json_report(name):
    entry = EXPECTED[name]
    result = CliRunner().invoke(cli, ["validate", str(CORPUS / name), "--format", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == (0 if entry["valid"] else 1), result.output
    report = json.loads(result.stdout)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert {f["code"] for f in errors} == set(entry["codes"])
    assert {f["path"] for f in errors} == set(entry["paths"])


@pytest.mark.parametrize("name", [n for n in FILES if "CK001" not in EXPECTED[n]["codes"]])
def test_only_schema_files_break_the_schema(name):
    """The rule files are schema-valid: what they break only the rules see (the schema alone cannot)."""
    doc = load_document(CORPUS / name)
    if doc["format_version"].startswith("1.0."):
        assert list(SCHEMA.iter_errors(doc)) == []


def _set(path: tuple, value):
    def edit(doc):
        *parents, last = path
        for p in parents:
            doc = doc[p]
        doc[last] = value

    return edit


def _pop(path: tuple):
    def edit(doc):
        *parents, last = path
        for p in parents:
            doc = doc[p]
        del doc[last]

    return edit


SCHEMA_CASES = [
    ("format-version-not-semver", _set(("format_version",), "1.0")),
    ("producer-without-tool", _pop(("producer", "tool"))),
    ("world-size-string", _set(("world_size",), "2")),
    ("world-size-float", _set(("world_size",), 2.5)),
    ("metadata-size-negative", _set(("metadata", "size"), -1)),
    ("metadata-unknown-field", _set(("metadata", "pickle"), "x")),
    ("metadata-version-empty", _set(("metadata", "version"), "")),
    ("file-without-size", _pop(("files", 0, "size"))),
    ("file-hash-algorithm", _set(("files", 0, "hash", "algorithm"), "md5")),
    ("file-path-empty", _set(("files", 0, "path"), "")),
    ("tensor-without-chunks", _pop(("tensors", 1, "chunks"))),
    ("tensor-dtype", _set(("tensors", 1, "dtype"), "float4")),
    ("tensor-shape-negative", _set(("tensors", 1, "shape"), [-1, 16])),
    ("tensor-name-empty", _set(("tensors", 1, "name"), "")),
    ("chunk-offsets-not-a-list", _set(("tensors", 1, "chunks", 0, "offsets"), 0)),
    ("chunk-length-bool", _set(("tensors", 1, "chunks", 0, "length"), True)),
    ("chunk-digest-short", _set(("tensors", 1, "chunks", 0, "digest", "sha256"), "ab")),
    ("chunk-digest-empty", _set(("tensors", 1, "chunks", 0, "digest"), {})),
    ("chunk-without-file", _pop(("tensors", 1, "chunks", 0, "file"))),
    ("bytes-without-length", _pop(("bytes", 0, "length"))),
    ("bytes-offset-over-int64", _set(("bytes", 0, "offset"), 2**63)),
    ("no-bytes", _pop(("bytes",))),
    ("unknown-top-level", _set(("future",), 1)),
]


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=lambda c: c[0])
def test_schema_and_models_agree_on_mutations(case):
    """What the schema refuses (CK001) the models refuse too."""
    doc = load_document(CORPUS / "valid" / "fsdp2-ws2-hashed.json")
    case[1](doc)
    assert list(SCHEMA.iter_errors(doc))
    with pytest.raises(ValidationError):
        DcpDocument.model_validate(copy.deepcopy(doc))
    assert validate_dcp_document(doc).findings[0].code == "CK001"


@pytest.mark.parametrize("name", FILES)
def test_schema_and_models_agree_on_the_corpus(name):
    doc = load_document(CORPUS / name)
    if doc.get("format_version", "").split(".")[:2] != ["1", "0"]:
        return  # another version: the gate decides (CK003, CK004)
    schema_ok = not list(SCHEMA.iter_errors(doc))
    try:
        DcpDocument.model_validate(copy.deepcopy(doc))
        model_ok = True
    except ValidationError:
        model_ok = False
    assert schema_ok == model_ok


def _required(model: type[BaseModel]) -> set[str]:
    return {k for k, f in model.model_fields.items() if f.is_required()}


def test_the_schema_objects_are_the_models():
    """Structure: every object of the schema has its model's fields, required fields and enumerations."""
    pairs = {
        "(document)": DcpDocument,
        "metadata": dcp_models.MetadataFile,
        "file": dcp_models.DcpFile,
        "tensor": dcp_models.DcpTensor,
        "chunk": dcp_models.DcpChunk,
        "bytes_item": dcp_models.BytesItem,
        "digest": dcp_models.ChunkDigest,
    }
    objects = {n for n, d in SCHEMA_DOC["$defs"].items() if d.get("type") == "object"} | {"(document)"}
    assert objects == set(pairs) | {"producer", "hash"}  # the manifest's, shared (models.Producer, models.Hash)
    for name, model in pairs.items():
        node = SCHEMA_DOC if name == "(document)" else SCHEMA_DOC["$defs"][name]
        assert set(node["properties"]) == set(model.model_fields), name
        assert set(node["required"]) == _required(model), name
        assert node["additionalProperties"] is False and model.model_config["extra"] == "forbid", name
    dtypes = typing.get_args(dcp_models.DcpTensor.model_fields["dtype"].annotation)
    assert set(SCHEMA_DOC["$defs"]["dtype"]["enum"]) == set(dtypes)
    assert SCHEMA_DOC["properties"]["format"]["const"] == dcp_models.DCP_FORMAT


def test_versions():
    doc = load_document(CORPUS / "valid" / "fsdp2-ws3.json")
    doc["format_version"] = "2.0.0"
    assert [f.code for f in validate_dcp_document(doc).findings] == ["CK003"]
    doc["format_version"] = "1.3.0"
    doc["future_field"] = {"x": 1}
    report = validate_dcp_document(doc)
    assert [f.code for f in report.findings] == ["CK004"] and report.ok
    assert report.document.to_dict()["future_field"] == {"x": 1}  # kept


def test_dispatch_by_format(tmp_path):
    """``load`` reads every kind; a manifest reader refuses a DCP document by name (CK005); nothing migrates it."""
    path = CORPUS / "valid" / "fsdp2-ws3.json"
    assert isinstance(load(path), DcpDocument)
    with pytest.raises(InvalidManifest) as refused:
        load_manifest(path)
    assert [f.code for f in refused.value.findings] == ["CK005"] and "DCP" in refused.value.findings[0].message
    assert [f.code for f in validate_document(load_document(path)).findings] == ["CK005"]
    with pytest.raises(MigrationError, match="CK311|no migration"):
        migrate(load_document(path), "1.1")
    assert SCHEMAS_BY_KIND["dcp"] == ({"1.0": "dcp-1.0.schema.json"}, "1.0")
    listed = CliRunner().invoke(cli, ["schema", "--list"]).stdout
    assert "dcp 1.0 dcp-1.0.schema.json *" in listed.splitlines()
