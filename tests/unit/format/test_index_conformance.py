"""The checkpoint index corpora (tests/conformance/checkpoint-1.0 and checkpoint-1.1, by make_index_corpus.py and
make_index_corpus_1_1.py) against ckptspec.

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
from ckptspec.format.schemas import INDEX_SCHEMAS, schema_findings, validator

ROOT = Path(__file__).resolve().parents[3]
CONFORMANCE = ROOT / "tests" / "conformance"
CORPUS = CONFORMANCE  # a file's name is "<corpus>/<valid or invalid>/<file>"
GENERATORS = {"checkpoint-1.0": "make_index_corpus.py", "checkpoint-1.1": "make_index_corpus_1_1.py"}
EXPECTED: dict[str, dict] = {
    f"{corpus}/{name}": entry
    for corpus in GENERATORS
    for name, entry in json.loads((CONFORMANCE / corpus / "expected.json").read_text("utf-8")).items()
}
FILES = sorted(p.relative_to(CORPUS).as_posix() for c in GENERATORS for p in (CORPUS / c).glob("*/*.json"))
# Schema-valid documents that a reader refuses: only the rules (a domain manifest's CK1xx, the index's CK6xx) see them.
SEMANTIC = [n for n in FILES if EXPECTED[n]["codes"] and not {"CK001", "CK003"} & set(EXPECTED[n]["codes"])]


def _errors(report) -> tuple[set[str], set[str], set[str]]:
    errors = [f for f in report.findings if f.severity == "error"]
    warnings = {f.code for f in report.findings if f.severity == "warning"}
    return {f.code for f in errors}, warnings, {f.path for f in errors}


@pytest.mark.parametrize("generator", sorted(GENERATORS.values()))
def test_corpus_is_reproducible(capsys, generator):
    spec = importlib.util.spec_from_file_location(f"_{generator[:-3]}", CONFORMANCE / generator)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def test_expected_lists_exactly_the_corpus_files():
    assert set(EXPECTED) == set(FILES)
    for corpus, (valid_at_least, invalid_at_least) in {"checkpoint-1.0": (8, 40), "checkpoint-1.1": (4, 12)}.items():
        mine = [n for n in FILES if n.startswith(corpus + "/")]
        valid = [n for n in mine if EXPECTED[n]["valid"]]
        assert len(valid) >= valid_at_least and len(mine) - len(valid) >= invalid_at_least


@pytest.mark.parametrize("name", FILES)
def test_entry_is_well_formed(name):
    entry = EXPECTED[name]
    assert entry["valid"] == (not entry["codes"]) == (name.split("/")[1] == "valid") == (not entry["paths"])
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
    assert list(validator(INDEX_SCHEMAS[name.split("/")[0].removeprefix("checkpoint-")]).iter_errors(doc)) == []
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
