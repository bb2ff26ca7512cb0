"""``reconstruct --jobs N``: several threads fill each safetensors file (export/parallel_write.py).

The one-thread path is proven bit-exact against DeepSpeed's zero_to_fp32 and the live engine
(test_reconstruct.py); here every multi-threaded output must be the same bytes as it, on real
DeepSpeed checkpoints: copied as stored, cast, hashed (format 1.1 tensor digests), split into
shards, and with tensors cut into many pieces. A failure in one thread leaves nothing behind.
"""

from __future__ import annotations

import errno

import pytest

from ckptspec.deepspeed.describe import describe
from ckptspec.deepspeed.describe.digests import add_digests
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
from ckptspec.export import api
from ckptspec.format.codec import dumps


def _files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="session")
def _run(ckptspec_process):
    def _run(*args: str) -> None:
        result = ckptspec_process(args)
        assert result.returncode == 0, result.stdout + result.stderr

    return _run


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("s2-bf16-ws2", []),
        ("s3-fp16-ws3-groups", ["--dtype", "bf16"]),
        ("s1-fp32-ws3-rr", ["--max-shard-size", "4KB", "--untie"]),
        ("s1-bf16-ws2", ["--dtype", "fp16"]),  # frozen params come from the module, cast
        ("tp2-s1-fp32-ws2", []),  # a checkpoint index: the whole model composed from both ranks' shards
        ("pp2dp2-s1-fp32-ws4", ["--dtype", "bf16", "--max-shard-size", "4KB"]),
    ],
)
def test_jobs_write_the_same_bytes_as_one_thread(_run, ds, name, options, tmp_path):
    save_dir = ds.path(name)
    _run("reconstruct", str(save_dir), str(tmp_path / "one"), "--quiet", *options)
    _run("reconstruct", str(save_dir), str(tmp_path / "three"), "--quiet", "--jobs", "3", *options)
    one, three = _files(tmp_path / "one"), _files(tmp_path / "three")
    assert len(one) > (1 if "--max-shard-size" in options else 0)
    assert three == one


def test_tensors_cut_into_pieces_and_hashed_tensors(ds, tmp_path, monkeypatch):
    """Pieces of 256 bytes (every tensor of the test model is cut), and a manifest with tensor digests
    (each hashed tensor is one task, its digest checked as it is written)."""
    from ckptspec.export import parallel_write

    save_dir = ds.path("s2-fp32-ws3-rr")
    api.reconstruct(save_dir, tmp_path / "one")
    monkeypatch.setattr(parallel_write, "PIECE", 256)
    api.reconstruct(save_dir, tmp_path / "pieces", jobs=2)
    assert _files(tmp_path / "pieces") == _files(tmp_path / "one")

    manifest = describe(save_dir)
    add_digests(manifest, resolve_tag_dir(save_dir))
    assert any(p.digest for g in manifest.groups for p in g.params)
    path = tmp_path / "hashed.json"
    path.write_bytes(dumps(manifest.to_dict()))
    api.reconstruct(save_dir, tmp_path / "hashed-one", manifest=path)
    api.reconstruct(save_dir, tmp_path / "hashed-two", manifest=path, jobs=2)
    assert _files(tmp_path / "hashed-two") == _files(tmp_path / "hashed-one")


def test_a_failing_thread_leaves_the_output_directory_as_it_was(ds, tmp_path, monkeypatch):
    from ckptspec.export import parallel_write, safetensors_writer

    out = tmp_path / "out"
    api.reconstruct(ds.path("s2-bf16-ws2"), out)
    before = _files(out)
    calls = []
    real = safetensors_writer.copy_bytes

    def full_disk(*args):
        calls.append(args)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(safetensors_writer, "copy_bytes", full_disk)
    monkeypatch.setattr(parallel_write, "PIECE", 512)
    with pytest.raises(OSError, match="No space left"):
        api.reconstruct(ds.path("s2-fp16-ws2-groups"), out, jobs=2)
    assert len(calls) >= 5
    assert _files(out) == before  # no temporary left either


def test_jobs_below_one_are_refused(ckptspec_process, ds, tmp_path):
    with pytest.raises(ValueError, match="jobs"):
        api.reconstruct(ds.path("s2-bf16-ws2"), tmp_path / "out", jobs=0)
    result = ckptspec_process(("reconstruct", str(ds.path("s2-bf16-ws2")), str(tmp_path / "o"), "--jobs", "0"))
    assert result.returncode == 2
    assert "--jobs" in result.stderr
