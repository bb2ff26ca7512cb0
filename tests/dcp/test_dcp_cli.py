"""``ckptspec validate DCP_DIR`` (issue #42): a torch DCP checkpoint recognised by its ``.metadata``; exit 0 valid,
1 invalid or unsafe, 2 unreadable; never a traceback, never the checkpoint's pickles run. The faults' codes are
tests/dcp/test_dcp_faults.py's (which runs the command on each)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_a_real_save_is_valid_and_its_pickles_listed(world_size, ds):
    directory = ds.path(dcp_save_name(world_size)) / "dcp"
    result = _run("validate", directory)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{directory}: 24 bytes entries (pickles, read by the restricted reader, nothing run): "
        "optim.param_groups.0.weight_decay, optim.param_groups.0.lr, optim.param_groups.0.betas, ... (21 more)",
        f"{directory}: valid",
    ]
    report = json.loads(_run("validate", directory, "--format", "json").output)
    assert report["valid"] is True and report["findings"] == []


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_forged_metadata_is_refused_by_the_command(ds, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    metadata = FileSystemReader(str(directory)).read_metadata()
    metadata.storage_meta, metadata.version = None, _Payload(tmp_path / "ran")
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    for output in ("text", "json"):
        result = _run("validate", directory, "--format", output)
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
    assert json.loads(result.output)["error"]["code"] == "CK204"
    assert "references global posix.system, which is not allowlisted" in json.loads(result.output)["error"]["message"]
    assert not (tmp_path / "ran").exists()


def test_an_unreadable_metadata_is_an_io_error(ds, tmp_path, ckptspec_process):
    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(1)) / "dcp", directory)
    (directory / ".metadata").chmod(0)
    result = ckptspec_process(["validate", str(directory)], unprivileged=True)
    assert result.returncode == 2, result.stderr
    assert "CK901 cannot read: Permission denied" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_tag_is_a_usage_error(ds):
    result = _run("validate", ds.path(dcp_save_name(1)) / "dcp", "--tag", "global_step2")
    assert result.exit_code == 2
    assert "a DCP checkpoint (.metadata) has none" in result.output


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_inspect_summarizes_a_save_from_its_metadata(world_size, ds):
    import torch

    entry = ds.path(dcp_save_name(world_size))
    oracle = torch.load(entry / "oracle.pt", weights_only=True)
    result = _run("inspect", entry / "dcp", "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["valid"] is True and doc["kind"] == "dcp" and doc["version"] == "1.0.0"
    params = oracle["params"]
    moments = [t for m in oracle["state"].values() for t in m.values()]
    assert doc["groups"]["model"] == {
        "tensors": len(params),
        "numel": sum(t.numel() for t in params.values()),
        "nbytes": sum(t.numel() * t.element_size() for t in params.values()),
    }
    assert doc["groups"]["optim"]["tensors"] == len(moments)
    assert doc["groups"]["optim"]["numel"] == sum(t.numel() for t in moments)
    assert len(doc["bytes_entries"]) == 24
    files = sorted((entry / "dcp").glob("*.distcp"))
    assert [(f["name"], f["bytes"]) for f in doc["files"]] == [(f.name, f.stat().st_size) for f in files]
    assert doc["largest"][0] == {
        "name": "model.emb.weight",
        "dtype": "float32",
        "shape": [50, 16],
        "chunks": world_size,
    }

    text = _run("inspect", entry / "dcp", "--top", "1")
    assert text.exit_code == 0
    assert (
        text.output.splitlines()[0]
        == f"{entry / 'dcp'}: torch DCP checkpoint (metadata version 1.0.0), {world_size} files"
    )


def test_inspect_does_not_summarize_a_damaged_save(ds, tmp_path):
    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    (directory / "__0_0.distcp").unlink()
    result = _run("inspect", directory)
    assert result.exit_code == 1
    assert "CK252 __0_0.distcp is missing" in result.output
    assert f"{directory}: not summarized: the checkpoint has errors" in result.output
