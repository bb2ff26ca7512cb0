"""What `reconstruct` does with its output directory: never a file that is not its own, never a mix.

Issue #22 (items 2, 3, 7, 9, 12) and #21: an empty OUTPUT_DIR, files of an output's name that
ckptspec did not write, earlier outputs of the other format, the manifest stored once, a
second writer at the same time, SIGTERM and Ctrl-C, and the name an error gives.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from _harness.states import hidden, visible
from click.testing import CliRunner

from ckptspec.cli import cli


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


@pytest.fixture(scope="module")
def ckpt(ds) -> Path:
    return ds.path("s2-bf16-ws2")


def test_an_empty_output_dir_is_a_usage_error(ckpt, tmp_path, monkeypatch):
    """Was: `reconstruct CKPT ""` wrote into the current directory and deleted model shards there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"someone's weights")
    result = _run("reconstruct", ckpt, "")
    assert result.exit_code == 2 and "an empty path" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["model-00001-of-00002.safetensors"]
    assert _run("reconstruct", ckpt, tmp_path / "model-00001-of-00002.safetensors").exit_code == 2  # a file
    assert _run("generate", ckpt, "-o", "").exit_code == 2


def test_files_ckptspec_did_not_write_are_never_touched(ckpt, tmp_path):
    """A Hugging Face model directory (shards, index, config): CK909, exit 2, nothing changed."""
    hf = tmp_path / "hf"
    hf.mkdir()
    for name, data in {
        "model-00001-of-00002.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
        "model-00002-of-00002.safetensors": b"not even safetensors",
        "model.safetensors.index.json": json.dumps({"metadata": {"total_size": 1}, "weight_map": {}}).encode(),
        "config.json": b"{}",
    }.items():
        (hf / name).write_bytes(data)
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    result = _run("reconstruct", ckpt, hf)
    assert result.exit_code == 2
    assert "CK909" in result.output and "was not written by ckptspec" in result.output
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    # Other files (a config, a tokenizer) are simply left beside the output.
    other = tmp_path / "with-config"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert _run("reconstruct", ckpt, other, "-q").exit_code == 0
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "model.safetensors"]


def test_a_new_format_replaces_ckptspecs_earlier_output_of_the_other(ckpt, tmp_path):
    """Was: `--format torch` into an OUT holding an earlier model.safetensors left it there, and
    loaders (transformers prefers safetensors) loaded the stale weights."""
    out = tmp_path / "out"
    assert _run("reconstruct", ckpt, out, "-q", "--max-shard-size", "2K").exit_code == 0
    assert any(p.name.startswith("model-0000") for p in out.iterdir())
    assert _run("reconstruct", ckpt, out, "-q", "--format", "torch").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin", "pytorch_model.bin.index.json"]
    assert _run("reconstruct", ckpt, out, "-q").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_the_optimizer_state_is_an_output_like_the_weights(ckpt, tmp_path):
    """Was (format 1.1's first version): `--optimizer-state` replaced any `optimizer.safetensors`
    with exit 0, after the weights' commit, and a later run without the flag left the earlier
    run's optimizer state beside the new weights."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "optimizer.safetensors").write_bytes(b"someone's optimizer state")
    result = _run("reconstruct", ckpt, out, "-q", "--optimizer-state")
    assert result.exit_code == 2 and "CK909" in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["optimizer.safetensors"]
    assert (out / "optimizer.safetensors").read_bytes() == b"someone's optimizer state"
    (out / "optimizer.safetensors").unlink()
    assert _run("reconstruct", ckpt, out, "-q", "--optimizer-state").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.safetensors"]
    assert any(k.startswith("ckptspec.") for k in _header(out / "optimizer.safetensors")["__metadata__"])
    assert _run("reconstruct", ckpt, out, "-q").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_the_manifest_is_stored_once(ckpt, tmp_path):
    """Was: every shard and the index carried the pretty-printed manifest (286 MB for 9 MiB of weights
    at 100k tensors). Now: in the index of a sharded output (compact), and each shard names it."""
    out = tmp_path / "out"
    assert _run("reconstruct", ckpt, out, "-q", "--max-shard-size", "2K").exit_code == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    text = index["metadata"]["ckptspec.manifest"]
    assert "\n" not in text and json.loads(text)["layout"]["zero_stage"] == 2
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    for shard in shards:
        meta = _header(shard)["__metadata__"]
        assert "ckptspec.manifest" not in meta and meta["ckptspec.manifest_in"] == "model.safetensors.index.json"
        assert meta["ckptspec.manifest_sha256"] == index["metadata"]["ckptspec.manifest_sha256"]
        assert len(json.dumps(_header(shard))) < len(text)  # the header is the tensors', not a manifest copy
    # extract finds it through the directory, through the index and through any shard.
    for target in (out, out / "model.safetensors.index.json", shards[-1]):
        shown = _run("extract", target)
        assert shown.exit_code == 0 and json.loads(shown.stdout) == json.loads(text), target
    # A single file carries it itself.
    single = tmp_path / "single"
    assert _run("reconstruct", ckpt, single, "-q").exit_code == 0
    assert json.loads(_header(single / "model.safetensors")["__metadata__"]["ckptspec.manifest"]) == json.loads(text)


def test_a_second_writer_into_the_same_directory_is_refused(crash, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running `reconstruct` holds
        result = crash.run(["reconstruct", ckpt, out])
    finally:
        os.close(fd)
    assert result.returncode == 2
    assert f"{out}: CK908 another ckptspec run is writing into this directory" in result.stderr
    assert list(out.iterdir()) == []


def test_a_second_embed_into_the_same_tag_directory_is_refused(crash, ckpt, tmp_path):
    """`embed` holds the tag directory like `reconstruct` holds its output (#21)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    tag_dir = copy / (copy / "latest").read_text().strip()
    before = visible(tag_dir)
    fd = os.open(tag_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running `embed` holds
        result = crash.run(["embed", copy])
    finally:
        os.close(fd)
    assert result.returncode == 2 and "CK908 another ckptspec run is writing into this directory" in result.stderr
    assert visible(tag_dir) == before and hidden(tag_dir) == []


@pytest.mark.parametrize("signal_name,code,word", [("term", 143, "terminated"), ("int", 130, "interrupted")])
def test_sigterm_and_ctrl_c_leave_nothing_and_say_so(crash, ckpt, tmp_path, signal_name, code, word):
    """Was: SIGTERM left the hidden temporary file, Ctrl-C exited 1 (the code for "invalid")."""
    out = tmp_path / "out"
    total = crash.steps(["reconstruct", ckpt, tmp_path / "counted", "-q"], tmp_path)
    for point in (2, total // 2):
        result = crash.run(["reconstruct", ckpt, out, "-q"], f"{signal_name}:{point}")
        assert result.returncode == code, (point, result.stderr)
        assert f"{word}; nothing was written" in result.stderr and "Traceback" not in result.stderr
        assert not out.exists() or list(out.iterdir()) == [], sorted(out.iterdir())


def test_an_unwritable_output_is_named_as_given(crash, ckpt, tmp_path):
    """Was: CK906 named an internal temporary path."""
    if os.geteuid() == 0:
        # root ignores permissions: a full disk stands in for them
        result = crash.run(["reconstruct", ckpt, tmp_path / "out"], "enospc:3")
    else:
        (tmp_path / "out").mkdir(mode=0o500)
        result = crash.run(["reconstruct", ckpt, tmp_path / "out"])
    assert result.returncode == 2
    assert result.stderr.startswith(f"{tmp_path / 'out'}: CK906 cannot write:"), result.stderr
    assert ".ckptspec-" not in result.stderr


def test_library_callers_get_the_same_guarantees(ckpt, tmp_path):
    """ckptspec.export.api.reconstruct (the Python API) refuses foreign files the same way."""
    from ckptspec.errors import ForeignOutput
    from ckptspec.export.api import reconstruct

    out = tmp_path / "out"
    out.mkdir()
    (out / "pytorch_model.bin").write_bytes(b"someone's torch weights")
    with pytest.raises(ForeignOutput) as info:
        reconstruct(ckpt, out)
    assert info.value.code == "CK909" and info.value.exit_code == 2
    assert [p.name for p in out.iterdir()] == ["pytorch_model.bin"]
