"""Two independent JSON Schema engines give ckptspec's verdicts on the conformance corpus.

* ajv 8 (JavaScript, ``ajv/dist/2020``, strict mode), run by ``examples/node-reader/validate.js``:
  one node process validates every corpus file and prints one JSON verdict per file.
  The npm packages come from ``examples/node-reader/package-lock.json`` (``scripts/env.sh`` runs
  ``npm ci``); the example reader uses the same ajv, so one lockfile serves both.
* check-jsonschema (Python CLI, ECMA-262 regexes through ``regress``), one process for all files.

"Schema-level verdict", file by file (see also tests/conformance/README.md):

* raw: does the schema of the document's own version (``schema/manifest-1.0.schema.json`` for a
  1.0 document, ``manifest-1.1.schema.json`` for a 1.1 one or a newer minor) accept it? For every
  file of both corpora (tests/conformance/1.0 and 1.1), each engine must agree with
  ``ckptspec.format.schemas.schema_findings(doc)`` (no version gate, no tolerance).
* as a reader applies it: the version gate runs first. A CK003 file (another major) never reaches
  the schema, so only its raw verdict is compared. A CK004 file (newer minor) is checked with
  ``additionalProperties`` failures ignored, as ``schema_findings(doc, allow_unknown=True)`` does.
  The schema then refuses the document exactly when its expected codes hold CK001.
  CK9xx codes (undecodable input) have no corpus file: decoding comes before any schema.

msgpack corpus files are decoded with ``msgpack`` and given to both engines as JSON.

One disagreement is real and expected: JavaScript numbers are doubles, so ajv reads the
integer 2**63 as 2**63 - 1's double and accepts ``CK001-schema-numel-above-int64``. The node checker
refuses any integer above 2**53 - 1 for that reason (docs/loaders.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from ckptspec.format.codec import load_document
from ckptspec.format.validate import schema_findings, validate_document

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {v: ROOT / "schema" / f"manifest-{v}.schema.json" for v in ("1.0", "1.1")}
SCHEMA = SCHEMAS["1.0"]
CORPUS = ROOT / "tests" / "conformance"  # corpus file names are "<version>/valid/..." paths
NODE_DIR = ROOT / "examples" / "node-reader"
EXPECTED: dict[str, dict] = {
    f"{v}/{name}": entry
    for v in ("1.0", "1.1")
    for name, entry in json.loads((CORPUS / v / "expected.json").read_text("utf-8")).items()
}
FILES = sorted(EXPECTED)

# (engine, corpus file) -> why the engine's raw verdict differs from ckptspec's. Strict: the
# divergence must happen, so a fix shows up as a failure here.
JS_DOUBLE = "JSON.parse rounds 2**63 to the double of 2**63 - 1, the schema's maximum"
DIVERGENCES = {
    ("ajv", "1.0/invalid/CK001-schema-numel-above-int64.json"): JS_DOUBLE,
    ("ajv", "1.0/invalid/CK001-schema-numel-above-int64.msgpack"): JS_DOUBLE,
}


def node_modules() -> Path:
    modules = NODE_DIR / "node_modules" / "ajv"
    assert modules.is_dir(), f"{modules} is missing: run ./scripts/env.sh (npm ci in {NODE_DIR})"
    return modules


def run_node_validate(files: list[Path], *extra: str) -> subprocess.CompletedProcess:
    node_modules()
    return subprocess.run(
        ["node", str(NODE_DIR / "validate.js"), *extra, *map(str, files)], capture_output=True, text=True, timeout=120
    )


def run_check_jsonschema(files: list[Path], *extra: str, schema: Path = SCHEMA) -> dict[str, list[dict]]:
    """File -> its errors, from one check-jsonschema process."""
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), "-o", "json", *extra, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report.get("parse_errors", []) == [], report["parse_errors"]
    errors: dict[str, list[dict]] = {str(f): [] for f in files}
    for error in report.get("errors", []):
        errors[error["filename"]].append(error)
    return errors


@pytest.fixture(scope="module")
def as_json(tmp_path_factory) -> dict[str, Path]:
    """Corpus name -> a JSON file with its document (msgpack files decoded and re-encoded)."""
    out = {}
    scratch = tmp_path_factory.mktemp("msgpack-as-json")
    for name in FILES:
        path = CORPUS / name
        if path.suffix == ".msgpack":
            doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=True)
            path = scratch / (name.replace("/", "__") + ".json")
            path.write_text(json.dumps(doc), "utf-8")
        out[name] = path
    return out


@pytest.fixture(scope="module")
def ajv(as_json) -> dict[str, dict]:
    proc = run_node_validate([as_json[n] for n in FILES])
    assert proc.returncode == 1, proc.stderr  # 1: some files are invalid
    assert proc.stderr == "", f"ajv warned or failed:\n{proc.stderr}"
    by_path = {json.loads(line)["file"]: json.loads(line) for line in proc.stdout.splitlines()}
    return {name: by_path[str(as_json[name])] for name in FILES}


@pytest.fixture(scope="module")
def check_jsonschema(as_json) -> dict[str, list[dict]]:
    # --regex-variant default: ECMA-262, the dialect JSON Schema's `pattern` is defined in.
    out = {}
    for version, schema in SCHEMAS.items():
        names = [n for n in FILES if _version_of(as_json[n]) == version]
        errors = run_check_jsonschema([as_json[n] for n in names], "--regex-variant", "default", schema=schema)
        out.update({name: errors[str(as_json[name])] for name in names})
    return out


def _version_of(path: Path) -> str:
    """The schema version a reader picks for the document in ``path`` (ckptspec.format.schemas.schema_version_of)."""
    doc = json.loads(path.read_text("utf-8"))
    version = doc.get("format_version") if isinstance(doc, dict) else None
    line = ".".join(version.split(".")[:2]) if isinstance(version, str) else None
    return line if line in SCHEMAS else "1.1"


@pytest.fixture(scope="module")
def ckptspec_verdicts() -> dict[str, dict]:
    """Name -> ckptspec's raw schema verdict, its verdict with a newer minor's tolerance, its error codes."""
    out = {}
    for name in FILES:
        doc = load_document(CORPUS / name)
        report = validate_document(doc)
        out[name] = {
            "raw": not schema_findings(doc),
            "tolerant": not schema_findings(doc, allow_unknown=newer_minor(name)),
            "codes": sorted({f.code for f in report.findings if f.severity == "error"}),
        }
    return out


def newer_minor(name: str) -> bool:
    return "CK004" in EXPECTED[name]["warnings"]


# --------------------------------------------------------------------------- ajv's compilation


def format_keywords(node) -> list[str]:
    """Values of every `format` keyword in a schema (a property *named* format is not one)."""
    if isinstance(node, list):
        return [f for v in node for f in format_keywords(v)]
    if not isinstance(node, dict):
        return []
    found = [node["format"]] if isinstance(node.get("format"), str) else []
    for key, value in node.items():
        children = value.values() if key in ("properties", "$defs") and isinstance(value, dict) else [value]
        found += [f for child in children for f in format_keywords(child)]
    return found


@pytest.mark.parametrize("version", SCHEMAS)
def test_schema_has_no_format_keyword(version):
    """So ajv needs no ajv-formats: strict mode would refuse an unknown format (test below)."""
    schema = json.loads(SCHEMAS[version].read_text("utf-8"))
    assert "format" in schema["properties"] and format_keywords(schema) == []
    schema["$defs"]["producer"]["properties"]["created"]["format"] = "date-time"
    assert format_keywords(schema) == ["date-time"]


@pytest.mark.parametrize("name", ["1.0/valid/no-files.json", "1.1/valid/stage2-bf16-ws2-complete.json"])
def test_ajv_compiles_schema_in_strict_mode_without_warnings(as_json, name):
    proc = run_node_validate([as_json[name]])
    assert (proc.returncode, proc.stderr) == (0, "")
    assert json.loads(proc.stdout)["raw_valid"] is True


@pytest.mark.parametrize(
    "edit,message",
    [
        (("count", "minimun", 0), 'strict mode: unknown keyword: "minimun"'),
        (("semver", "format", "semver"), 'unknown format "semver" ignored in schema'),
    ],
)
def test_ajv_strict_mode_refuses_a_sloppy_schema(tmp_path, as_json, edit, message):
    """The strict check above can fail: a typo'd keyword or an unknown format stop the compile."""
    schema = json.loads(SCHEMA.read_text("utf-8"))
    definition, key, value = edit
    schema["$defs"][definition][key] = value
    sloppy = tmp_path / "sloppy.schema.json"
    sloppy.write_text(json.dumps(schema), "utf-8")
    proc = run_node_validate([as_json["1.0/valid/no-files.json"]], "--schema", str(sloppy))
    assert proc.returncode == 2
    assert proc.stderr == f"{sloppy}: ajv cannot compile the schema: {message}" + (
        ' at path "#/$defs/semver"\n' if "format" in message else "\n"
    )


# --------------------------------------------------------------------------- verdicts, file by file


@pytest.mark.parametrize("name", FILES)
def test_raw_schema_verdicts_agree(name, ajv, check_jsonschema, ckptspec_verdicts):
    reference = ckptspec_verdicts[name]["raw"]
    verdicts = {"ajv": ajv[name]["raw_valid"], "check-jsonschema": not check_jsonschema[name]}
    for engine, accepts in verdicts.items():
        if (engine, name) in DIVERGENCES:
            assert accepts != reference, f"{engine} now agrees on {name}: remove it from DIVERGENCES"
        else:
            assert accepts == reference, (
                f"{engine} {'accepts' if accepts else 'refuses'} {name}, ckptspec "
                f"{'accepts' if reference else 'refuses'} it: {ajv[name]['raw_errors'] or check_jsonschema[name]}"
            )


@pytest.mark.parametrize("name", [n for n in FILES if "CK003" not in EXPECTED[n]["codes"]])
def test_schema_level_verdict_as_a_reader_applies_it(name, ajv, check_jsonschema, ckptspec_verdicts):
    tolerant = newer_minor(name)
    expected = "CK001" not in EXPECTED[name]["codes"]
    assert ckptspec_verdicts[name]["tolerant"] == expected
    ajv_errors = [e for e in ajv[name]["raw_errors"] if not (tolerant and e["keyword"] == "additionalProperties")]
    # check-jsonschema's JSON report has no keyword: jsonschema's additionalProperties message it is.
    cj_errors = [
        e
        for e in check_jsonschema[name]
        if not (tolerant and e["message"].startswith("Additional properties are not allowed"))
    ]
    if ("ajv", name) not in DIVERGENCES:
        assert (not ajv_errors) == expected, ajv_errors
    assert (not cj_errors) == expected, cj_errors


@pytest.mark.parametrize("name", FILES)
def test_node_checker_reports_the_expected_codes(name, ajv, ckptspec_verdicts):
    """validate.js's full check (gate, ajv + the 2**53 guard, rules CK101-CK126) = expected.json = ckptspec."""
    assert ajv[name]["codes"] == sorted(EXPECTED[name]["codes"]) == ckptspec_verdicts[name]["codes"]
    assert ajv[name]["warnings"] == sorted(EXPECTED[name]["warnings"])


def test_divergences_are_the_js_double_rounding(ajv):
    for _engine, name in DIVERGENCES:
        assert ajv[name]["raw_valid"] is True  # ajv alone accepts 2**63 ...
        assert ajv[name]["codes"] == ["CK001"]  # ... the node checker's 2**53 guard refuses it
        big = [v for v in iter_numbers(load_document(CORPUS / name)) if v > 2**53 - 1]
        assert big == [2**63] and float(2**63) == float(2**63 - 1)


def iter_numbers(node):
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            yield from iter_numbers(value)
    elif isinstance(node, int) and not isinstance(node, bool):
        yield node


# --------------------------------------------------------------------------- where engines see less than ckptspec


def test_python_regex_dialect_would_accept_a_trailing_newline(as_json):
    """Why check-jsonschema runs with ECMA-262 regexes: with Python's, '$' matches before a final newline."""
    name = "1.0/invalid/CK001-schema-semver-trailing-newline.json"
    python = run_check_jsonschema([as_json[name]], "--regex-variant", "python")
    ecma = run_check_jsonschema([as_json[name]], "--regex-variant", "default")
    assert python[str(as_json[name])] == []
    assert [e["path"] for e in ecma[str(as_json[name])]] == ["$.format_version"]


def test_duplicate_keys_are_invisible_to_schema_engines(tmp_path):
    """Both JSON parsers keep the last of two equal keys; only ckptspec refuses the document (CK904)."""
    text = (CORPUS / "1.0" / "valid" / "deepspeed-zero2-bf16-2ranks.json").read_text("utf-8")
    doubled = tmp_path / "duplicate-key.json"
    doubled.write_text(text.replace('"format_version"', '"format_version": "9.9.9", "format_version"', 1), "utf-8")
    proc = run_node_validate([doubled])
    assert json.loads(proc.stdout)["raw_valid"] is True
    assert run_check_jsonschema([doubled]) == {str(doubled): []}
    cli = subprocess.run([sys.executable, "-m", "ckptspec", "validate", str(doubled)], capture_output=True, text=True)
    assert cli.returncode == 1 and "CK904 duplicate key 'format_version'" in cli.stdout + cli.stderr
