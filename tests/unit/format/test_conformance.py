"""The conformance corpora (tests/conformance/1.0 and 1.1) against ckptspec.

Every corpus file is validated in-process (``validate_file``) and through the CLI
(click's runner for all, a real ``python -m ckptspec`` subprocess for a handful);
the verdict, the exit code and the exact set of error and warning codes must match
its corpus's ``expected.json``, and every JSON report must match ``schema/report-1.0.schema.json``.
Files are named by their path below tests/conformance (``1.1/valid/no-digests.json``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from ckptspec.cli import cli
from ckptspec.format.codec import load_document
from ckptspec.format.documents import validate_file
from ckptspec.format.rules import RULES

ROOT = Path(__file__).resolve().parents[3]
CONFORMANCE = ROOT / "tests" / "conformance"
CORPUS = CONFORMANCE  # names below are "<version>/valid/..." paths
VERSIONS = ("1.0", "1.1")
EXPECTED: dict[str, dict] = {
    f"{version}/{name}": entry
    for version in VERSIONS
    for name, entry in json.loads((CONFORMANCE / version / "expected.json").read_text("utf-8")).items()
}
FILES = sorted(
    p.relative_to(CONFORMANCE).as_posix()
    for version in VERSIONS
    for p in (CONFORMANCE / version).glob("*/*")
    if p.suffix in (".json", ".msgpack")
)
REPORT_VALIDATOR = Draft202012Validator(json.loads((ROOT / "schema" / "report-1.0.schema.json").read_text("utf-8")))

# Corpus files whose expectation is right but ckptspec currently gets wrong. Strict:
# once the bug is fixed the test XPASSes, which fails, and the entry must go.
KNOWN_BUGS: dict[str, str] = {}

# A handful of files run through a real subprocess: one of each kind.
SUBPROCESS_FILES = [
    "1.0/valid/deepspeed-zero2-bf16-2ranks.json",
    "1.0/valid/newer-minor-1.4.0-unknown-fields.json",
    "1.0/valid/stage3-per-param-two-subgroups-ws3.msgpack",
    "1.0/invalid/CK001-schema-top-level-array.json",
    "1.0/invalid/CK001-schema-numel-above-int64.msgpack",
    "1.0/invalid/CK003-format-major-2.json",
    "1.0/invalid/CK113-unsafe-path-windows-drive.json",
    "1.0/invalid/CK117-locator-numel-mismatch.msgpack",
    "1.1/valid/deepspeed-zero2-bf16-2ranks.json",
    "1.1/valid/stage3-fragments-subgroups-ws3.msgpack",
    "1.1/invalid/CK001-schema-1.0-document-with-1.1-field.json",
    "1.1/invalid/CK125-state-numel-is-saved-numel.msgpack",
]


def _params(names):
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[n])) if n in KNOWN_BUGS else n
        for n in names
    ]


def _expected_exit(name: str) -> int:
    return 0 if EXPECTED[name]["valid"] else 1


def _codes(findings: list[dict], severity: str) -> set[str]:
    return {f["code"] for f in findings if f["severity"] == severity}


# --------------------------------------------------------------------------- the corpus itself


def test_index_lists_exactly_the_corpus_files():
    assert set(EXPECTED) == set(FILES)


@pytest.mark.parametrize("version", VERSIONS)
def test_corpus_size(version):
    files = [n for n in FILES if n.startswith(version + "/")]
    valid = [n for n in files if EXPECTED[n]["valid"]]
    assert len(files) >= 40
    assert len(valid) >= 12
    assert len(files) - len(valid) >= 30
    assert any(n.endswith(".msgpack") for n in valid) and any(n.endswith(".msgpack") for n in files if n not in valid)


@pytest.mark.parametrize("name", FILES)
def test_index_entry_is_well_formed(name):
    entry = EXPECTED[name]
    assert {"valid", "codes", "warnings"} <= entry.keys()
    assert isinstance(entry["valid"], bool)
    assert entry["valid"] == (not entry["codes"])
    assert entry["valid"] == (name.split("/")[1] == "valid")
    for code in entry["codes"] + entry["warnings"]:
        assert code.startswith("CK") and len(code) == 5 and code[2:].isdigit()
    if not entry["valid"]:
        # invalid files are named for the rule they break: CK105-alias-shape-transposed.json
        assert Path(name).name[:5] in entry["codes"]


def test_every_code_is_covered():
    covered = {code for e in EXPECTED.values() for code in e["codes"] + e["warnings"]}
    wanted = {r.code for r in RULES} | {"CK001", "CK003", "CK004"}
    assert not wanted - covered, f"codes without a corpus file: {sorted(wanted - covered)}"
    # CK002 (schema and models disagree) is a ckptspec bug, never an expectation.
    assert "CK002" not in covered
    # Format 1.1's rules, and the 1.0 rules that now cover 1.1's locators, have 1.1 files.
    in_1_1 = {code for n, e in EXPECTED.items() if n.startswith("1.1/") for code in e["codes"]}
    assert {"CK115", "CK118", "CK119", "CK120", "CK121", "CK122", "CK123", "CK124", "CK125", "CK126"} <= in_1_1


def test_corpus_json_is_plain_json():
    """Corpus JSON files decode with the standard library alone (no NaN, no duplicate keys)."""

    def strict_pairs(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"duplicate key in {keys}"
        return dict(pairs)

    def refuse(token):
        raise AssertionError(f"{token} in a corpus file")

    for name in FILES:
        if name.endswith(".json"):
            json.loads((CORPUS / name).read_text("utf-8"), object_pairs_hook=strict_pairs, parse_constant=refuse)


def test_valid_stage0_examples_name_only_files_deepspeed_writes():
    """#17: DeepSpeed writes no ``*_optim_states.pt`` at ZeRO stage 0 (``save_zero_checkpoint`` stays
    False; the real stage-0 saves of tests/deepspeed/test_parallel_harness.py hold
    ``mp_rank_00_model_states.pt`` only): a valid stage-0 example locates its masters there."""
    stage0 = []
    for name in FILES:
        if "/valid/" in name and name.endswith(".json"):
            doc = json.loads((CORPUS / name).read_text("utf-8"))
            if doc["layout"]["zero_stage"] == 0:
                stage0.append(name)
                assert {f["role"] for f in doc["files"]} <= {"model_states", "other"}, name
                assert all(
                    Path(f["path"]).name == "mp_rank_00_model_states.pt" for f in doc["files"] if f["partitions"]
                )
    assert stage0, "no stage-0 example left in the corpus"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_conformance_{name}", CONFORMANCE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["make_corpus", "make_msgpack"])
def test_generated_files_are_reproducible(script, capsys):
    assert _load_script(script).main(["--check"]) == 0, capsys.readouterr().err


def test_msgpack_files_decode_to_their_json_siblings():
    for name in FILES:
        if name.endswith(".msgpack"):
            sibling = name[: -len(".msgpack")] + ".json"
            assert sibling in EXPECTED
            assert load_document(CORPUS / name) == load_document(CORPUS / sibling)
            assert {k: v for k, v in EXPECTED[name].items() if k != "description"} == {
                k: v for k, v in EXPECTED[sibling].items() if k != "description"
            }


# --------------------------------------------------------------------------- ckptspec on the corpus


@pytest.mark.parametrize("name", _params(FILES))
def test_validate_file(name):
    expected = EXPECTED[name]
    report = validate_file(CORPUS / name)
    errors = {f.code for f in report.findings if f.severity == "error"}
    warnings = {f.code for f in report.findings if f.severity == "warning"}
    assert (errors, warnings) == (set(expected["codes"]), set(expected["warnings"]))
    assert report.ok == expected["valid"]
    for finding in report.findings:
        assert finding.path.startswith("$") and finding.message and finding.hint
    if expected["valid"]:
        assert report.manifest is not None
        # a valid document dumps back to itself (integral floats compare equal to ints)
        assert report.manifest.to_dict() == load_document(CORPUS / name)


@pytest.mark.parametrize("name", _params(FILES))
def test_cli_json_report(name):
    result = CliRunner().invoke(cli, ["validate", str(CORPUS / name), "--format", "json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.exit_code == _expected_exit(name)
    report = json.loads(result.stdout)
    REPORT_VALIDATOR.validate(report)
    assert report["valid"] == EXPECTED[name]["valid"]
    assert "error" not in report
    assert _codes(report["findings"], "error") == set(EXPECTED[name]["codes"])
    assert _codes(report["findings"], "warning") == set(EXPECTED[name]["warnings"])


@pytest.mark.parametrize("name", _params(FILES))
def test_cli_text_output(name):
    result = CliRunner().invoke(cli, ["validate", str(CORPUS / name)])
    assert "Traceback" not in result.output
    assert result.exit_code == _expected_exit(name)
    lines = result.stdout.splitlines()
    if EXPECTED[name]["valid"]:
        assert lines[-1].endswith(": valid")
    for code in EXPECTED[name]["codes"] + EXPECTED[name]["warnings"]:
        assert any(f" {code} " in line for line in lines), (code, lines)


@pytest.mark.parametrize("name", SUBPROCESS_FILES)
def test_cli_subprocess(name):
    assert name in EXPECTED
    proc = subprocess.run(
        [sys.executable, "-m", "ckptspec", "validate", str(CORPUS / name), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert proc.returncode == _expected_exit(name)
    report = json.loads(proc.stdout)
    REPORT_VALIDATOR.validate(report)
    assert report["valid"] == EXPECTED[name]["valid"]
    assert report["target"] == str(CORPUS / name)
    assert _codes(report["findings"], "error") == set(EXPECTED[name]["codes"])
    assert _codes(report["findings"], "warning") == set(EXPECTED[name]["warnings"])
