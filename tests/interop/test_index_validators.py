"""ajv and check-jsonschema judge the checkpoint index corpora (tests/conformance/checkpoint-1.0, checkpoint-1.1) as
ckptspec does.

The engines and their setup are those of test_other_validators.py (ajv 8 strict through
``examples/node-reader/validate.js``, which dispatches on ``format``; check-jsonschema with ECMA-262 regexes,
one process per schema). File by file:

* raw: the corpus's schema (``schema/checkpoint-1.x.schema.json``) alone accepts the document exactly when
  ckptspec's reference validator does (``schema_findings(doc, ...)``: no version gate, no tolerance).
* as a reader applies it (every file but the CK003 ones, another major): the index schema, with a newer
  minor's ``additionalProperties`` failures ignored, then, where it passes, each domain's manifest against
  the manifest schema of its own version (the index schema takes any object there; docs/spec-checkpoint.md).
  The document is refused exactly when its expected codes hold CK001, and at exactly its expected paths:
  check-jsonschema reports each error where ckptspec does; ajv too, and adds the failures of each branch of a
  ``oneOf``/``anyOf``, always below that path.
* the Node checker's full verdict (gate, schemas, the domains' 1.x rules, CK602-CK610) is the expected codes.

The schema-valid files a reader still refuses (a domain manifest's CK1xx, the index rules CK6xx: their
expected codes hold neither CK001 nor CK003) are accepted by both engines on both levels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptspec.findings import json_path
from ckptspec.format.codec import load_document
from ckptspec.format.documents import validate_file
from ckptspec.format.schemas import INDEX_SCHEMAS, schema, schema_findings

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "conformance"  # a file's name is "<corpus>/<valid or invalid>/<file>"
CORPORA = {"checkpoint-1.0": INDEX_SCHEMAS["1.0"], "checkpoint-1.1": INDEX_SCHEMAS["1.1"]}  # -> its schema file
MANIFEST_SCHEMAS = {v: ROOT / "schema" / f"manifest-{v}.schema.json" for v in ("1.0", "1.1")}
NODE_DIR = ROOT / "examples" / "node-reader"
EXPECTED: dict[str, dict] = {
    f"{corpus}/{name}": entry
    for corpus in CORPORA
    for name, entry in json.loads((CORPUS / corpus / "expected.json").read_text("utf-8")).items()
}
FILES = sorted(EXPECTED)
ADDITIONAL = "Additional properties are not allowed"  # jsonschema's additionalProperties message

# (engine, corpus file) -> why its raw verdict differs from ckptspec's. Strict: the divergence must happen.
DIVERGENCES = {
    ("ajv", "checkpoint-1.0/invalid/CK001-schema-layer-size-above-int64.json"): (
        "JSON.parse rounds 2**63 to the double of 2**63 - 1"
    )
}


def index_schema(name: str) -> str:
    """The schema file of a corpus file's corpus."""
    return CORPORA[name.split("/")[0]]


def newer_minor(name: str) -> bool:
    return "CK004" in EXPECTED[name]["warnings"]


def manifest_version(doc) -> str:
    """The manifest schema a reader picks for a domain manifest (ckptspec.format.schemas.schema_version_of)."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    line = ".".join(version.split(".")[:2]) if isinstance(version, str) else None
    return line if line in MANIFEST_SCHEMAS else "1.1"


def pointer_path(pointer: str) -> str:
    """ajv's instancePath (a JSON pointer) as a JSON path: "/domains/0/size" -> "$.domains[0].size"."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    return json_path(*(int(p) if p.isdigit() else p for p in parts))


def at_or_below(path: str, top: str) -> bool:
    return path == top or path.startswith((top + ".", top + "["))


def run_check_jsonschema(files: list[Path], schema_file: Path) -> dict[str, list[dict]]:
    """File -> its errors, from one check-jsonschema process (ECMA-262 regexes: JSON Schema's dialect)."""
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema_file), "--regex-variant", "default"]
        + ["-o", "json", *map(str, files)],
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
def domain_manifests(tmp_path_factory) -> dict[str, list[Path]]:
    """Corpus name -> each of its domain manifests in a file of its own (where the index schema lets a reader on)."""
    scratch = tmp_path_factory.mktemp("domain-manifests")
    out: dict[str, list[Path]] = {}
    for name in FILES:
        doc = load_document(CORPUS / name)
        if "CK003" in EXPECTED[name]["codes"] or schema_findings(doc, schema(index_schema(name)), allow_unknown=True):
            continue
        out[name] = []
        for i, dom in enumerate(doc["domains"]):
            path = scratch / f"{name.replace('/', '__')}__{i}.json"
            path.write_text(json.dumps(dom["manifest"]), "utf-8")
            out[name].append(path)
    return out


@pytest.fixture(scope="module")
def ajv(domain_manifests) -> dict[str, dict]:
    """File -> validate.js's verdict: the corpus files, then the domain manifests, in one node process."""
    assert (NODE_DIR / "node_modules" / "ajv").is_dir(), f"run ./scripts/env.sh (npm ci in {NODE_DIR})"
    files = [CORPUS / n for n in FILES] + [p for paths in domain_manifests.values() for p in paths]
    proc = subprocess.run(
        ["node", str(NODE_DIR / "validate.js"), *map(str, files)], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr
    return {json.loads(line)["file"]: json.loads(line) for line in proc.stdout.splitlines()}


@pytest.fixture(scope="module")
def check_jsonschema(domain_manifests) -> dict[str, list[dict]]:
    """File -> check-jsonschema's errors: the corpus files by the index schema, each domain manifest by its own."""
    out: dict[str, list[dict]] = {}
    for corpus, schema_file in CORPORA.items():
        out.update(
            run_check_jsonschema(
                [CORPUS / n for n in FILES if n.startswith(corpus + "/")], ROOT / "schema" / schema_file
            )
        )
    manifests = [p for paths in domain_manifests.values() for p in paths]
    for version, schema_file in MANIFEST_SCHEMAS.items():
        mine = [p for p in manifests if manifest_version(json.loads(p.read_text("utf-8"))) == version]
        if mine:
            out.update(run_check_jsonschema(mine, schema_file))
    return out


def reader_errors(name: str, domain_manifests, errors_of) -> list[tuple[str, str]]:
    """(JSON path, what) of every error an engine reports as a reader applies the schemas: the index's (a newer
    minor's unknown fields tolerated), then, where it passes, each domain manifest's, at its place in the index."""
    found = errors_of(CORPUS / name, newer_minor(name))
    if found or name not in domain_manifests:
        return found
    for i, path in enumerate(domain_manifests[name]):
        top = json_path("domains", i, "manifest")
        found += [(top + p[1:], what) for p, what in errors_of(path, False)]
    return found


# --------------------------------------------------------------------------- verdicts, file by file


@pytest.mark.parametrize("name", FILES)
def test_raw_index_schema_verdicts_agree(name, ajv, check_jsonschema):
    reference = not schema_findings(load_document(CORPUS / name), schema(index_schema(name)))
    verdicts = {
        "ajv": ajv[str(CORPUS / name)]["raw_valid"],
        "check-jsonschema": not check_jsonschema[str(CORPUS / name)],
    }
    for engine, accepts in verdicts.items():
        if (engine, name) in DIVERGENCES:
            assert accepts != reference, f"{engine} now agrees on {name}: remove it from DIVERGENCES"
        else:
            assert accepts == reference, f"{engine} {'accepts' if accepts else 'refuses'} {name}, ckptspec does not"


@pytest.mark.parametrize("name", [n for n in FILES if "CK003" not in EXPECTED[n]["codes"]])
def test_schema_level_verdict_and_paths_as_a_reader_applies_them(name, ajv, check_jsonschema, domain_manifests):
    entry = EXPECTED[name]
    expected_paths = set(entry["paths"]) if "CK001" in entry["codes"] else set()

    def cj(path: Path, tolerant: bool) -> list[tuple[str, str]]:
        errors = [(e["path"], e["message"]) for e in check_jsonschema[str(path)]]
        return [e for e in errors if not (tolerant and e[1].startswith(ADDITIONAL))]

    def aj(path: Path, tolerant: bool) -> list[tuple[str, str]]:
        errors = [(pointer_path(e["path"]), e["keyword"]) for e in ajv[str(path)]["raw_errors"]]
        return [e for e in errors if not (tolerant and e[1] == "additionalProperties")]

    ckptspec = {f.path for f in validate_file(CORPUS / name).findings if f.code == "CK001"}
    assert ckptspec == expected_paths
    assert {p for p, _ in reader_errors(name, domain_manifests, cj)} == expected_paths
    if ("ajv", name) in DIVERGENCES:
        return
    ajv_paths = {p for p, _ in reader_errors(name, domain_manifests, aj)}
    assert expected_paths <= ajv_paths, ajv_paths
    assert all(any(at_or_below(p, top) for top in expected_paths) for p in ajv_paths), ajv_paths


@pytest.mark.parametrize("name", FILES)
def test_node_checker_reports_the_expected_codes(name, ajv):
    """validate.js's full check of an index = expected.json (= ckptspec: unit/format/test_index_conformance.py)."""
    verdict = ajv[str(CORPUS / name)]
    assert (verdict["codes"], verdict["warnings"]) == (EXPECTED[name]["codes"], EXPECTED[name]["warnings"])


def test_divergence_is_the_js_double_rounding(ajv):
    for _engine, name in DIVERGENCES:
        verdict = ajv[str(CORPUS / name)]
        assert verdict["raw_valid"] is True and verdict["codes"] == ["CK001"]  # the 2**53 guard refuses it
        assert load_document(CORPUS / name)["layer_files"][2]["size"] == 2**63 and float(2**63) == float(2**63 - 1)


def test_semantic_files_pass_both_engines(ajv, check_jsonschema, domain_manifests):
    """The schema-valid documents only the rules refuse: listed apart, accepted by both engines on both levels."""
    semantic = [n for n in FILES if EXPECTED[n]["codes"] and not {"CK001", "CK003"} & set(EXPECTED[n]["codes"])]
    assert {Path(n).name[:5] for n in semantic} == {"CK101", *(f"CK60{i}" for i in range(2, 10)), "CK610"}
    for name in semantic:
        assert ajv[str(CORPUS / name)]["raw_valid"] and not check_jsonschema[str(CORPUS / name)], name
        for path in domain_manifests[name]:
            assert ajv[str(path)]["raw_valid"] and not check_jsonschema[str(path)], (name, path)
