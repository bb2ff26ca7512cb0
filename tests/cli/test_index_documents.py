"""Issue #37 (M4): a checkpoint index, which `generate` writes and `validate` calls valid, is read by
every command and function that takes a document, or refused by name; never called an invalid
manifest (it was 9 x CK001 "'layout' is a required property" from convert, migrate, embed
--manifest, `ckptspec.validate_file` and `ckptspec.load_manifest`). Issue #39: `migrate` migrates it.

The index is the committed conformance document of a real pipeline x data parallel checkpoint; a
tampered copy proves the index is still validated (as an index) on the way in.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "tests" / "conformance" / "index-1.0" / "pp2dp2-s1-fp32-ws4.json"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr
    return result


def test_convert_round_trips_an_index(tmp_path):
    packed, back = tmp_path / "index.msgpack", tmp_path / "index.json"
    assert run("convert", INDEX, packed).exit_code == 0
    assert run("convert", packed, back).exit_code == 0
    assert json.loads(back.read_text()) == json.loads(INDEX.read_text())
    assert run("validate", packed).exit_code == 0


def test_convert_still_validates_an_index(tmp_path):
    doc = json.loads(INDEX.read_text())
    doc["topology"]["model_parallel_size"] = 3  # pipeline 2 x tensor 1 is 2: CK602
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = run("convert", bad, tmp_path / "out.msgpack")
    assert result.exit_code == 1 and "CK602" in result.stderr and "CK001" not in result.stderr
    assert not (tmp_path / "out.msgpack").exists()


def test_migrate_migrates_the_manifest_of_each_domain(tmp_path):
    # Issue #39: it was refused (CK311); the index schema takes any 1.x manifest in a domain.
    result = run("migrate", INDEX, tmp_path / "out.json", "--to", "1.0")
    assert result.exit_code == 0 and "CK001" not in result.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert [d["manifest"]["format_version"] for d in out["domains"]] == ["1.0.0", "1.0.0"]
    assert out["format_version"] == "1.0.0" and run("validate", tmp_path / "out.json").exit_code == 0


def test_embed_refuses_an_index_manifest_by_name(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], checkpoint)
    before = {p.name: p.read_bytes() for p in (checkpoint / "global_step2").iterdir()}
    result = run("embed", checkpoint, "--manifest", INDEX)
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"{checkpoint / 'global_step2'}: CK304 the manifest given is a checkpoint index, but this is a ZeRO "
        "data-parallel checkpoint (a format 1.x manifest) "
    )
    assert "CK001" not in result.stderr
    assert {p.name: p.read_bytes() for p in (checkpoint / "global_step2").iterdir()} == before


def test_validate_file_reads_an_index():
    report = ckptspec.validate_file(INDEX)
    assert report.ok and report.findings == []
    assert report.manifest.topology.degrees.pipeline == 2


def test_load_manifest_says_it_is_an_index():
    with pytest.raises(ckptspec.InvalidManifest) as caught:
        ckptspec.load_manifest(INDEX)
    assert [f.code for f in caught.value.findings] == ["CK005"]
    assert "ckptspec.load reads every kind" in caught.value.findings[0].hint
