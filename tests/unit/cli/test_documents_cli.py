"""`ckptspec migrate` and `ckptspec schema` on documents of both kinds (issue #39).

`migrate` of a checkpoint index migrates the manifest of each of its domains (the index keeps its
version), from JSON or msgpack, and refuses `--checkpoint` by name; `schema` prints every shipped
schema by kind and version (`--list` names them). Indexes: the committed conformance documents of
real harness checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.format.codec import load_document
from ckptspec.format.documents import migrate

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "conformance" / "index-1.0"
INDEXES = sorted(p.name for p in FIXTURES.glob("*.json"))
SCHEMA_DIR = ROOT / "schema"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr and "Traceback" not in result.output + result.stderr
    return result


@pytest.mark.parametrize("name", INDEXES)
@pytest.mark.parametrize("source_encoding", ["json", "msgpack"])
@pytest.mark.parametrize("target", ["1.0", "1.1"])
def test_migrate_writes_the_index_with_migrated_domain_manifests(tmp_path, name, source_encoding, target):
    source = FIXTURES / name
    if source_encoding == "msgpack":
        source = tmp_path / "index.msgpack"
        assert run("convert", FIXTURES / name, source).exit_code == 0
    out = tmp_path / "out.msgpack"
    result = run("migrate", source, out, "--to", target)
    assert result.exit_code == 0, result.stderr
    doc = json.loads((FIXTURES / name).read_text())
    assert load_document(str(out)) == migrate(doc, target).document
    count = len(doc["domains"])
    assert f"{out}: checkpoint index {target}.0, {count} domain manifest" in result.stdout
    assert f"at format {target}.0 (" in result.stdout
    dropped = re.findall(r"\$\.domains\[\d+\]\.manifest[^:]*: CK313 warning", result.stderr)
    assert len(dropped) == len([f for f in migrate(doc, target).findings if f.code == "CK313"])
    assert "CK001" not in result.stderr
    assert run("validate", out).exit_code == 0
    assert isinstance(ckptspec.load(out), ckptspec.CheckpointIndex)


def test_migrate_refuses_an_invalid_index_with_its_findings(tmp_path):
    doc = json.loads((FIXTURES / INDEXES[0]).read_text())
    doc["topology"]["model_parallel_size"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = run("migrate", bad, tmp_path / "out.json", "--to", "1.0")
    assert result.exit_code == 1 and "CK602" in result.stderr and "CK001" not in result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("name", INDEXES)
def test_migrate_refuses_to_fill_an_index_from_a_checkpoint(tmp_path, name):
    result = run("migrate", FIXTURES / name, tmp_path / "out.json", "--to", "1.1", "--checkpoint", tmp_path)
    assert result.exit_code == 1
    assert "CK311 --checkpoint fills" in result.stderr and "ckptspec generate" in result.stderr
    assert "CK001" not in result.stderr
    assert not (tmp_path / "out.json").exists()


def test_migrate_an_index_to_a_version_nothing_reaches(tmp_path):
    result = run("migrate", FIXTURES / INDEXES[0], tmp_path / "out.json", "--to", "2.0")
    assert result.exit_code == 1 and "CK311 no migration from format 1.1 to 2.0" in result.stderr
    assert not (tmp_path / "out.json").exists()


def test_schema_list_names_every_shipped_schema():
    result = run("schema", "--list")
    assert result.exit_code == 0
    rows = [line.split() for line in result.stdout.splitlines()]
    assert sorted(row[2] for row in rows) == sorted(p.name for p in SCHEMA_DIR.glob("*.schema.json"))
    for row in rows:
        kind_prefix = {"manifest": "manifest", "checkpoint-index": "checkpoint", "report": "report", "dcp": "dcp"}[
            row[0]
        ]
        assert row[2] == f"{kind_prefix}-{row[1]}.schema.json"
    latest = {row[0]: row[1] for row in rows if row[3:] == ["*"]}
    assert latest == {"manifest": "1.1", "checkpoint-index": "1.1", "report": "1.1", "dcp": "1.0"}


@pytest.mark.parametrize(
    ("flags", "prefix"),
    [((), "manifest"), (("--checkpoint-index",), "checkpoint"), (("--report",), "report"), (("--dcp",), "dcp")],
)
def test_schema_prints_every_kind_at_every_version(flags, prefix):
    files = sorted(SCHEMA_DIR.glob(f"{prefix}-*.schema.json"))
    assert files
    for path in files:
        version = path.name.removeprefix(f"{prefix}-").removesuffix(".schema.json")
        for given in (version, f"{version}.0"):
            result = run("schema", *flags, "--version", given)
            assert result.exit_code == 0 and result.stdout == path.read_text("utf-8")
    latest = run("schema", *flags)
    assert latest.exit_code == 0 and latest.stdout == files[-1].read_text("utf-8")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--version", "2.0"), "CK905 no manifest schema for format version 2.0 (known: 1.0, 1.1)"),
        (("--checkpoint-index", "--version", "1.2"), "CK905 no checkpoint-index schema for format version 1.2"),
        (("--report", "--version", "0.9"), "CK905 no report schema for format version 0.9"),
        (("--dcp", "--version", "1.1"), "CK905 no dcp schema for format version 1.1"),
    ],
)
def test_schema_refuses_an_unknown_version_of_its_kind(flags, message):
    result = run("schema", *flags)
    assert result.exit_code == 2 and result.stderr.startswith(message) and result.stdout == ""


def test_schema_takes_one_kind():
    result = run("schema", "--report", "--checkpoint-index")
    assert result.exit_code == 2 and "choose one" in result.stderr and result.stdout == ""
