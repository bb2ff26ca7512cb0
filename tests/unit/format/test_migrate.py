"""Version gating and migrations (issue #6): the released 1.0 <-> 1.1 steps, and the mechanism
exercised with a test-only 1.2 draft.

``tests/schema_drafts/manifest-1.2.schema.json`` is format 1.1 plus one OPTIONAL
top-level field, ``tag``. It is registered only inside these tests, with a 1.1 -> 1.2
and a 1.2 -> 1.1 migration; the released registry holds exactly 1.0 <-> 1.1.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.errors import InvalidInput, MigrationError
from ckptspec.format import migrate as mig
from ckptspec.format.codec import load_document
from ckptspec.format.migrate import (
    migrate_document,
    migration_path,
    registered,
    validate_own_version,
)
from ckptspec.format.validate import validate_document
from ckptspec.format.version import full_version, version_key

ROOT = Path(__file__).resolve().parents[3]
DRAFT = ROOT / "tests" / "schema_drafts" / "manifest-1.2.schema.json"
RELEASED = ROOT / "schema" / "manifest-1.1.schema.json"
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"
EXAMPLE_1_0 = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
CORPUS = ROOT / "tests" / "conformance" / "1.0"
RELEASED_STEPS = [("1.0", "1.1"), ("1.1", "1.0")]


def up_1_1_to_1_2(doc: dict) -> dict:
    # A newer minor only adds OPTIONAL fields: going up is a version bump.
    doc["format_version"] = "1.2.0"
    return doc


def down_1_2_to_1_1(doc: dict) -> dict:
    doc.pop("tag", None)
    doc["format_version"] = "1.1.0"
    return doc


@pytest.fixture
def draft():
    with registered({("1.1", "1.2"): up_1_1_to_1_2, ("1.2", "1.1"): down_1_2_to_1_1}, {"1.2": DRAFT}):
        yield


def example() -> dict:
    return json.loads(EXAMPLE.read_text("utf-8"))


def tagged() -> dict:
    doc = example()
    doc["format_version"] = "1.2.0"
    doc["tag"] = "global_step2"
    return doc


# --------------------------------------------------------------------------- the draft itself


def test_draft_is_release_plus_one_optional_field():
    draft, released = json.loads(DRAFT.read_text("utf-8")), json.loads(RELEASED.read_text("utf-8"))
    added = draft["properties"].pop("tag")
    assert added["type"] == "string" and "tag" not in draft["required"]
    for key in ("$id", "title", "$comment"):
        assert draft.pop(key) != released.pop(key)
    assert draft == released
    # Never shipped: the package knows only the released versions.
    assert not (ROOT / "schema" / DRAFT.name).exists()


def test_registry_holds_the_released_steps_outside_the_fixture():
    assert mig.known_migrations() == RELEASED_STEPS and mig._SCHEMAS == {}
    with registered({("1.1", "1.2"): up_1_1_to_1_2}, {"1.2": DRAFT}):
        assert mig.known_migrations() == [*RELEASED_STEPS, ("1.1", "1.2")]
    assert mig.known_migrations() == RELEASED_STEPS and mig._SCHEMAS == {}


# --------------------------------------------------------------------------- readers: version first


def test_newer_minor_is_read_with_a_warning_and_unknown_fields_kept():
    report = validate_document(tagged())
    assert report.ok
    assert [f.code for f in report.findings] == ["CK004"]
    assert report.manifest.to_dict()["tag"] == "global_step2"


def test_unknown_major_stops_before_anything_else():
    doc = example()
    doc["format_version"] = "2.0.0"
    doc["layout"] = "anything goes in another major"
    findings = validate_document(doc).findings
    assert [f.code for f in findings] == ["CK003"]
    assert "this reader understands major 1 only" in findings[0].message


def test_registered_draft_schema_checks_the_new_field(draft):
    assert validate_own_version(tagged()) == []  # the draft's own schema: no CK004, every field checked
    bad = tagged()
    bad["tag"] = ""
    assert [f.code for f in validate_own_version(bad)] == ["CK001"]
    # Patterns keep ECMA-262 anchors: "$" does not match before a final newline.
    newline = tagged()
    newline["files"][0]["hash"] = {"algorithm": "sha256", "digest": "0" * 64 + "\n"}
    assert "CK001" in {f.code for f in validate_own_version(newline)}
    # Semantic rules still run for a draft of the supported major.
    broken = tagged()
    broken["groups"][0]["params"][0]["numel"] = 1
    assert "CK101" in {f.code for f in validate_own_version(broken)}


# --------------------------------------------------------------------------- migrations


def test_up_then_down_is_identity(draft):
    up = migrate_document(example(), "1.2")
    assert up.steps == [("1.1", "1.2")]
    assert up.document["format_version"] == "1.2.0"
    assert {k: v for k, v in up.document.items() if k != "format_version"} == {
        k: v for k, v in example().items() if k != "format_version"
    }
    assert up.findings == []
    down = migrate_document(up.document, "1.1.0")
    assert down.document == example() and down.findings == []


def test_down_migration_reports_the_dropped_field(draft):
    result = migrate_document(tagged(), "1.1")
    assert "tag" not in result.document and result.document["format_version"] == "1.1.0"
    assert [(f.code, f.path, f.severity) for f in result.findings] == [("CK313", "$.tag", "warning")]
    assert validate_document(result.document).findings == []


def test_input_is_not_modified(draft):
    doc = tagged()
    before = copy.deepcopy(doc)
    migrate_document(doc, "1.0")
    assert doc == before


def test_shortest_path_through_several_steps(draft):
    draft13 = json.loads(DRAFT.read_text("utf-8"))
    draft13["properties"]["note"] = {"type": "string"}

    def up_1_2_to_1_3(doc):
        doc["format_version"] = "1.3.0"
        return doc

    with registered({("1.2", "1.3"): up_1_2_to_1_3}, {"1.3": draft13}):
        assert migration_path("1.0", "1.3") == [("1.0", "1.1"), ("1.1", "1.2"), ("1.2", "1.3")]
        assert migration_path("1.3", "1.0") is None
        result = migrate_document(json.loads(EXAMPLE_1_0.read_text("utf-8")), "1.3")
        assert result.steps == [("1.0", "1.1"), ("1.1", "1.2"), ("1.2", "1.3")]
        assert result.document["format_version"] == "1.3.0"
    assert migration_path("1.0", "1.0") == []


def test_no_path_is_ck311():
    with pytest.raises(MigrationError) as info:
        migrate_document(example(), "1.2", "m.json")
    assert info.value.code == "CK311" and info.value.exit_code == 1
    assert "no migration from format 1.1 to 1.2 (registered: 1.0 -> 1.1, 1.1 -> 1.0)" in info.value.message


def test_invalid_input_is_refused(draft):
    doc = example()
    doc["groups"][0]["params"][0]["numel"] = 1
    with pytest.raises(InvalidInput) as info:
        migrate_document(doc, "1.2")
    assert "CK101" in {f.code for f in info.value.findings}


def test_a_migration_producing_an_invalid_document_is_ck312():
    def broken(doc):
        doc["format_version"] = "1.2.0"
        doc["tag"] = 42  # the draft says string
        return doc

    with registered({("1.1", "1.2"): broken}, {"1.2": DRAFT}):
        with pytest.raises(MigrationError) as info:
            migrate_document(example(), "1.2")
    assert info.value.code == "CK312" and "$.tag" in info.value.message


def test_migration_must_return_an_object():
    with registered({("1.1", "1.2"): lambda doc: None}, {"1.2": DRAFT}):
        with pytest.raises(MigrationError, match="returned NoneType"):
            migrate_document(example(), "1.2")


def test_version_set_when_a_migration_forgets_it():
    with registered({("1.1", "1.2"): lambda doc: doc}, {"1.2": DRAFT}):
        assert migrate_document(example(), "1.2").document["format_version"] == "1.2.0"


def test_registry_guards():
    with pytest.raises(ValueError):
        mig.register_migration("1.0", "1.0.0", lambda d: d)
    with pytest.raises(ValueError, match="already registered"):
        mig.register_migration("1.0", "1.1", down_1_2_to_1_1)
    for bad in ("1", "1.0.0.0", "01.0", "a.b", "1.-1"):
        with pytest.raises(ValueError):
            version_key(bad)
    assert version_key("1.10.3") == "1.10" and full_version("1.2") == "1.2.0"


# --------------------------------------------------------------------------- ckptspec migrate


def test_cli_migrate_up_and_the_older_reader_accepts_it(draft, tmp_path):
    out = tmp_path / "m12.msgpack"
    result = CliRunner().invoke(cli, ["migrate", str(EXAMPLE), str(out), "--to", "1.2"])
    assert result.exit_code == 0, result.output
    assert result.output == f"{out}: format 1.2.0 (1.1 -> 1.2)\n"
    doc = load_document(out)
    assert doc["format_version"] == "1.2.0"
    # A 1.1 reader (subprocess: the draft is not registered there) reads 1.2 with a warning.
    checked = subprocess.run([sys.executable, "-m", "ckptspec", "validate", str(out)], capture_output=True, text=True)
    assert checked.returncode == 0 and "CK004 warning:" in checked.stdout


def test_cli_migrate_down_warns_about_dropped_fields(draft, tmp_path):
    source, out = tmp_path / "m12.json", tmp_path / "m11.json"
    source.write_text(json.dumps(tagged()), "utf-8")
    result = CliRunner().invoke(cli, ["migrate", str(source), str(out), "--to", "1.1.0"])
    assert result.exit_code == 0, result.output
    assert f"{source}: $.tag: CK313 warning: format 1.1 has no place for this field" in result.output
    assert json.loads(out.read_text("utf-8")) == example()


# --------------------------------------------------------------------------- the released 1.0 <-> 1.1


def test_every_valid_1_0_document_migrates_up_and_back_unchanged():
    """docs/versioning.md, adding a version: up then down is the identity on every valid 1.0 corpus file."""
    for path in sorted((CORPUS / "valid").glob("*.json")):
        doc = load_document(path)
        if doc["format_version"] != "1.0.0":
            continue  # the newer-minor file is not a 1.0 document
        up = migrate_document(doc, "1.1")
        assert up.document["format_version"] == "1.1.0" and up.findings == [], path.name
        assert migrate_document(up.document, "1.0").document == doc, path.name


def test_down_to_1_0_drops_exactly_what_1_1_added():
    """Every 1.1 field of the example goes, each reported once (CK313) at its outermost path; the rest stays."""
    down = migrate_document(example(), "1.0")
    assert down.document == json.loads(EXAMPLE_1_0.read_text("utf-8"))
    paths = [f.path for f in down.findings]
    assert all(f.code == "CK313" and f.severity == "warning" for f in down.findings)
    assert "$.optimizer" in paths and "$.save" in paths and "$.layout.byte_order" in paths
    assert "$.files[0].tensors" in paths and "$.files[2].state_partitions" in paths
    assert "$.groups[0].params[4].state_digests" in paths and "$.frozen[1].digest" in paths
    # 5 params x (digest, model_digest, state_digests) + 2 frozen + 2 buffers digests + 4 file locator
    # lists (tensors, model_weights, 2 x state_partitions) + byte_order, optimizer, save
    assert len(paths) == len(set(paths)) == 15 + 2 + 2 + 4 + 3


def test_cli_migrate_up_with_the_checkpoint_fills_1_1(tmp_path):
    """The 1.1 example is exactly `migrate --checkpoint` of the 1.0 example (its committed checkpoint)."""
    out = tmp_path / "up.json"
    checkpoint = ROOT / "tests" / "data" / "deepspeed-0.19.8" / "s2-bf16-ws2"
    result = CliRunner().invoke(
        cli, ["migrate", str(EXAMPLE_1_0), str(out), "--to", "1.1", "--checkpoint", str(checkpoint)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == EXAMPLE.read_bytes()
    plain = tmp_path / "plain.json"
    assert CliRunner().invoke(cli, ["migrate", str(EXAMPLE_1_0), str(plain), "--to", "1.1"]).exit_code == 0
    assert "optimizer" not in load_document(plain)  # without the checkpoint: a 1.1 document with no 1.1 field


def test_cli_migrate_refuses_a_checkpoint_the_manifest_does_not_describe(tmp_path):
    out = tmp_path / "up.json"
    other = ROOT / "tests" / "data" / "deepspeed-0.15.4" / "old-s2-fp32-ws2-groups"
    result = CliRunner().invoke(cli, ["migrate", str(EXAMPLE_1_0), str(out), "--to", "1.1", "--checkpoint", str(other)])
    assert result.exit_code == 1 and "CK304 the manifest does not describe this checkpoint" in result.output
    assert not out.exists()
    down = CliRunner().invoke(cli, ["migrate", str(EXAMPLE), str(out), "--to", "1.0", "--checkpoint", str(other)])
    assert down.exit_code == 2 and "format 1.0 has no field the checkpoint fills" in down.output


def test_cli_migrate_failures_write_nothing(tmp_path):
    out = tmp_path / "out.json"
    no_path = subprocess.run(
        [sys.executable, "-m", "ckptspec", "migrate", str(EXAMPLE_1_0), str(out), "--to", "2.0"],
        capture_output=True,
        text=True,
    )
    assert no_path.returncode == 1 and "CK311 no migration from format 1.0 to 2.0" in no_path.stderr
    assert "Traceback" not in no_path.stderr
    bad_version = subprocess.run(
        [sys.executable, "-m", "ckptspec", "migrate", str(EXAMPLE_1_0), str(out), "--to", "two"],
        capture_output=True,
        text=True,
    )
    assert bad_version.returncode == 2 and "--to" in bad_version.stderr
    invalid = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptspec",
            "migrate",
            str(CORPUS / "invalid" / "CK106-offset-gap.json"),
            str(out),
            "--to",
            "1.0",
        ],
        capture_output=True,
        text=True,
    )
    assert invalid.returncode == 1 and "CK106" in invalid.stderr
    major = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptspec",
            "migrate",
            str(CORPUS / "invalid" / "CK003-format-major-2.json"),
            str(out),
            "--to",
            "1.0",
        ],
        capture_output=True,
        text=True,
    )
    assert major.returncode == 1 and "CK311 no migration from format 2.0 to 1.0" in major.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_migrate_same_version_rewrites_canonically(tmp_path):
    out = tmp_path / "same.msgpack"
    result = subprocess.run(
        [sys.executable, "-m", "ckptspec", "migrate", str(EXAMPLE), str(out), "--to", "1.1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout == f"{out}: format 1.1.0 (no change)\n"
    assert load_document(out) == example()
