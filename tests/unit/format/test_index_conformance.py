"""The checkpoint index corpus (tests/conformance/checkpoint-1.0, by make_index_corpus.py) against ckptspec.

Every file is validated in-process (``validate_file``) and through the CLI (click's runner); the verdict,
the exit code, the sets of error and warning codes and the JSON paths of the errors must be those of
``expected.json``. tests/interop/test_index_validators.py holds ajv, check-jsonschema and the Node checker
to the same verdicts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.format.codec import load_document
from ckptspec.format.documents import validate_file
from ckptspec.format.index_rules import INDEX_RULES
from ckptspec.format.schemas import INDEX_SCHEMA, schema_findings, validator

ROOT = Path(__file__).resolve().parents[3]
CONFORMANCE = ROOT / "tests" / "conformance"
CORPUS = CONFORMANCE / "checkpoint-1.0"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text("utf-8"))
FILES = sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.glob("*/*.json"))
# Schema-valid documents that a reader refuses: only the rules (a domain manifest's CK1xx, the index's CK6xx) see them.
SEMANTIC = [n for n in FILES if EXPECTED[n]["codes"] and not {"CK001", "CK003"} & set(EXPECTED[n]["codes"])]


def _errors(report) -> tuple[set[str], set[str], set[str]]:
    errors = [f for f in report.findings if f.severity == "error"]
    warnings = {f.code for f in report.findings if f.severity == "warning"}
    return {f.code for f in errors}, warnings, {f.path for f in errors}


def test_corpus_is_reproducible(capsys):
    spec = importlib.util.spec_from_file_location("_make_index_corpus", CONFORMANCE / "make_index_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def test_expected_lists_exactly_the_corpus_files():
    assert set(EXPECTED) == set(FILES)
    valid = [n for n in FILES if EXPECTED[n]["valid"]]
    assert len(valid) >= 8 and len(FILES) - len(valid) >= 40


@pytest.mark.parametrize("name", FILES)
def test_entry_is_well_formed(name):
    entry = EXPECTED[name]
    assert entry["valid"] == (not entry["codes"]) == (name.startswith("valid/")) == (not entry["paths"])
    if not entry["valid"]:
        assert Path(name).name[:5] in entry["codes"]  # named for the rule it breaks
        assert all(path.startswith("$") for path in entry["paths"])


def test_every_code_is_covered():
    covered = {code for e in EXPECTED.values() for code in e["codes"] + e["warnings"]}
    assert {r.code for r in INDEX_RULES} | {"CK001", "CK003", "CK004"} <= covered


@pytest.mark.parametrize("name", FILES)
def test_validate_file(name):
    entry = EXPECTED[name]
    report = validate_file(CORPUS / name)
    assert _errors(report) == (set(entry["codes"]), set(entry["warnings"]), set(entry["paths"]))
    assert report.ok == entry["valid"]
    assert all(f.message and f.hint for f in report.findings)
    if entry["valid"]:
        assert report.index is not None and report.index.to_dict() == load_document(CORPUS / name)


@pytest.mark.parametrize("name", SEMANTIC)
def test_semantic_files_are_schema_valid(name):
    """What JSON Schema alone accepts: the index by its schema, and every domain manifest by its own."""
    doc = load_document(CORPUS / name)
    assert list(validator(INDEX_SCHEMA).iter_errors(doc)) == []
    assert [f for dom in doc["domains"] for f in schema_findings(dom["manifest"])] == []


def test_semantic_files_are_listed_apart():
    assert {Path(n).name[:5] for n in SEMANTIC} >= {r.code for r in INDEX_RULES} | {"CK101"}


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
    assert {f["code"] for f in report["findings"] if f["severity"] == "warning"} == set(entry["warnings"])
