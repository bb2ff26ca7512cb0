"""Issue #22, defect 1: shard files that are symbolic links, as the Hugging Face hub cache, DVC,
git-annex and deduplicating stores lay them out.

A manifest path is checked as written (CK113: a plain relative path inside the tag directory);
the file it names may be a link to anywhere. ``validate``, ``reconstruct`` and
``load_state_dict`` agree on every layout, and the weights are those of the original files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli

TAG = "global_step2"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A real DeepSpeed ZeRO-2 checkpoint (committed by the harness: no job to run)."""
    dest = tmp_path_factory.mktemp("orig") / "CKPT"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], dest)
    assert run("embed", dest).exit_code == 0  # a sidecar too, so that it is linked like the shards
    return dest


def _absolute(original: Path, root: Path) -> Path:
    (root / TAG).mkdir(parents=True)
    (root / "latest").write_text(TAG)
    for f in (original / TAG).iterdir():
        (root / TAG / f.name).symlink_to(f.resolve())
    return root


def _relative(original: Path, root: Path) -> Path:
    (root / TAG).mkdir(parents=True)
    (root / "latest").write_text(TAG)
    for f in (original / TAG).iterdir():
        (root / TAG / f.name).symlink_to(os.path.relpath(f, root / TAG))
    return root


def _hub(original: Path, root: Path) -> Path:
    """The Hugging Face hub cache: snapshots/<rev>/... -> ../../../blobs/<sha256>."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    snapshot = root / "snapshots" / "0123abcd"
    (snapshot / TAG).mkdir(parents=True)
    (snapshot / "latest").write_text(TAG)
    for f in (original / TAG).iterdir():
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / TAG / f.name).symlink_to(os.path.relpath(blob, snapshot / TAG))
    return snapshot


def _linked_tag_dir(original: Path, root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "latest").write_text(TAG)
    (root / TAG).symlink_to((original / TAG).resolve(), target_is_directory=True)
    return root


LAYOUTS = {"absolute": _absolute, "relative": _relative, "hub-cache": _hub, "linked-tag-dir": _linked_tag_dir}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validate_reconstruct_and_load_agree_on_linked_shards(original, tmp_path, layout):
    linked = LAYOUTS[layout](original, tmp_path / "L")
    assert any(p.is_symlink() for p in [linked / TAG, *(linked / TAG).iterdir()])

    result = run("validate", linked)
    assert result.exit_code == 0, result.output

    expected, got = tmp_path / "expected", tmp_path / "got"
    assert run("reconstruct", "-q", original, expected).exit_code == 0
    result = run("reconstruct", linked, got)
    assert result.exit_code == 0, result.output + result.stderr
    assert (got / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()

    state = ckptspec.load_state_dict(linked, framework="numpy")
    reference = ckptspec.load_state_dict(original, framework="numpy")
    assert state.keys() == reference.keys()
    for name, array in reference.items():
        assert np.array_equal(state[name], array), name


def test_a_manifest_path_outside_the_directory_is_still_refused(original, tmp_path):
    """What CK113 guards is the path the manifest writes, not where a link on disk leads."""
    import json

    manifest = json.loads((original / TAG / "ckptspec.json").read_text())
    manifest["files"][0]["path"] = f"../{TAG}/{manifest['files'][0]['path']}"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(manifest))
    for args in (
        ["validate", bad, "--checkpoint", original],
        ["reconstruct", original, tmp_path / "OUT", "--manifest", bad],
    ):
        result = run(*args)
        assert result.exit_code == 1 and "CK113" in result.output + result.stderr, result.output
    assert not (tmp_path / "OUT").exists()
