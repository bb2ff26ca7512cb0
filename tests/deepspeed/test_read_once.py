"""Every file is read once and a manifest validated once, on real DeepSpeed checkpoints.

``read_pt_metadata`` (the restricted unpickler) is counted per file while ``validate DIR``,
``reconstruct`` and ``embed`` run in-process; the semantic rules are counted per command,
since a manifest the caller validated is handed on as its report, not validated again.
``inspect DIR`` on a checkpoint with an unreadable shard lists the findings like
``validate DIR`` instead of stopping at the first one.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec.checkpoint import torchfile
from ckptspec.cli import cli
from ckptspec.deepspeed.embed import embed_checkpoint
from ckptspec.format import validate as validate_module

CHECKPOINTS = [
    "s2-bf16-ws2",  # no sidecar: the manifest is generated
    "s3-bf16-ws2-sub",  # stage 3: a model-states file per rank
    "embed-s1-fp16-ws2",  # saved by ckptspec.deepspeed.save_checkpoint: sidecar and client-state copies
]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def save_dir(request, ds) -> Path:
    return ds.path(request.param)


@pytest.fixture
def reads(monkeypatch) -> collections.Counter:
    """Reads of data.pkl by resolved path (ckptspec reads every .pt through read_data_pkl: alone, or
    from read_pt_metadata)."""
    counter: collections.Counter = collections.Counter()
    real = torchfile.read_data_pkl

    def counted(path, *args, **kwargs):
        counter[Path(path).resolve()] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torchfile, "read_data_pkl", counted)
    return counter


@pytest.fixture
def rule_runs(monkeypatch) -> list[int]:
    """One entry per run of the semantic rules (once per validated manifest)."""
    runs: list[int] = []
    real = validate_module.check_document

    def counted(doc):
        runs.append(1)
        return real(doc)

    monkeypatch.setattr(validate_module, "check_document", counted)
    return runs


def _tag_dir(save_dir: Path) -> Path:
    return save_dir / (save_dir / "latest").read_text().strip()


def _pt_files(tag_dir: Path) -> set[Path]:
    return {p.resolve() for p in tag_dir.iterdir() if p.suffix == ".pt"}


def _run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_validate_dir_reads_each_file_once(save_dir, reads, rule_runs):
    result = _run("validate", str(save_dir), "--no-hash")
    assert result.exit_code == 0, result.output
    assert set(reads) == _pt_files(_tag_dir(save_dir))
    assert set(reads.values()) == {1}, reads
    assert len(rule_runs) == 1


def test_reconstruct_reads_each_file_once(save_dir, reads, rule_runs, tmp_path):
    result = _run("reconstruct", "-q", str(save_dir), str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert set(reads) == _pt_files(_tag_dir(save_dir))
    assert set(reads.values()) == {1}, reads
    assert len(rule_runs) == 1


def test_a_validated_manifest_is_not_validated_again(save_dir, reads, rule_runs, tmp_path):
    manifest = tmp_path / "manifest.json"
    assert _run("generate", str(save_dir), "-o", str(manifest)).exit_code == 0
    reads.clear()
    assert _run("validate", str(manifest), "--checkpoint", str(save_dir), "--no-hash").exit_code == 0
    assert len(rule_runs) == 1 and set(reads.values()) == {1}
    rule_runs.clear()
    reads.clear()
    assert _run("reconstruct", "-q", str(save_dir), str(tmp_path / "out"), "--manifest", str(manifest)).exit_code == 0
    assert len(rule_runs) == 1 and set(reads.values()) == {1}


def test_embed_describes_the_directory_once(save_dir, reads, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(save_dir, copy)
    tag_dir = _tag_dir(copy)
    expected = _pt_files(tag_dir)
    result = embed_checkpoint(copy)
    assert {path: n for path, n in reads.items() if path in expected} == dict.fromkeys(expected, 1)
    # The only other reads: each rewritten model-states file, read back (once) under its temporary name.
    others = {path: n for path, n in reads.items() if path not in expected}
    assert all(path.name.startswith(".") and n == 1 for path, n in others.items()), others
    assert len(others) <= len(result.model_states)
    assert json.loads(result.sidecar.read_text())["files"]


@pytest.mark.parametrize("damaged", [1, 2])
def test_inspect_lists_unreadable_shards(damaged, ds, tmp_path):
    """Like `validate DIR`: every unreadable file is a finding naming it, exit 1, no traceback."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path("s2-bf16-ws2"), copy)
    victims = sorted(_tag_dir(copy).glob("*_optim_states.pt"))[:damaged]
    for victim in victims:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result = _run("inspect", str(copy))
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if "CK205" in line]
    assert [victim.name in line for victim, line in zip(victims, lines)] == [True] * damaged
    assert len(lines) == damaged
    report = json.loads(_run("inspect", str(copy), "--format", "json").output)
    assert report["valid"] is False
    assert sorted(f["file"] for f in report["findings"] if f["code"] == "CK205") == [v.name for v in victims]
