"""#42: a torch DCP checkpoint at a URL (nginx; moto's S3 through s3fs) read by every command that reads one on disk:
``validate``, ``inspect``, ``diff``, ``reconstruct`` (``--optimizer-state`` too), ``ckptspec.load_state_dict`` and
``reshard DCP_URL OUT``. The real FSDP2 saves of tests/_harness/dcp_save_job.py: the outputs from the URL are the
local ones byte for byte and the saving job's ``full_tensor()``; the ``.distcp`` files are read in range requests
(nginx's access log: no answer shares a byte with another, none is a whole file), and a file missing or cut short
at the URL gives the codes it gives on disk (CK252, CK253), naming the URL, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name
from click.testing import CliRunner
from jsonschema import Draft202012Validator

import ckptspec
from ckptspec import location
from ckptspec.cli import cli
from ckptspec.errors import RemoteError, UnsafePickleError

ROOT = Path(__file__).resolve().parents[2]
REPORT_1_1 = Draft202012Validator(json.loads((ROOT / "schema" / "report-1.1.schema.json").read_text("utf-8")))
# small reads: a 1 KiB tail, no read-ahead, 4 KiB pieces, so that these small files (43 and 81 KB at ws 2) are not
# each fetched whole by the first read of their tail (docs/remote.md's "small reads")
SMALL = {"TAIL": 1024, "READ_AHEAD": 0, "CHUNK": 4096}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def run_json(*args) -> tuple[int, dict]:
    result = run(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def ranges_sent(lines) -> list[tuple[str, int, int]]:
    """(file, first byte, bytes) of each 206 answer: what nginx sent of each file."""
    out = []
    for method, uri, status, sent, rng in lines:
        if method == "GET" and status == 206:
            out.append((uri.rsplit("/", 1)[-1], int(rng.removeprefix("bytes=").split("-")[0]), sent))
    return sorted(out)


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_reconstruct_over_http_is_the_local_one_read_in_ranges(world_size, nginx, ds, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    entry = ds.path(dcp_save_name(world_size))
    local, path = nginx.serve(entry / "dcp")
    assert run("reconstruct", local, tmp_path / "local", "--optimizer-state").exit_code == 0
    for setting, value in SMALL.items():
        monkeypatch.setattr(location.settings, setting, value)
    mark = nginx.mark()
    result = run("reconstruct", nginx.url(path), tmp_path / "url", "--optimizer-state")
    assert result.exit_code == 0, result.output
    lines = nginx.since(mark)
    assert files_of(tmp_path / "url") == files_of(tmp_path / "local")
    oracle = torch.load(entry / "oracle.pt", weights_only=True)
    weights = load_file(tmp_path / "url" / "model.safetensors")
    assert sorted(weights) == sorted(oracle["params"])
    for name, tensor in oracle["params"].items():  # the saving job's full_tensor()
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name
    moments = load_file(tmp_path / "url" / "optimizer.safetensors")
    for param, states in oracle["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[f"{param}.{key}"], states[key]), f"{param}.{key}"

    # Range requests only: no answer is a whole file, no two share a byte, nginx sent what ckptspec counted.
    files = sizes(local)
    sent = ranges_sent(lines)
    assert [line for line in lines if line[0] == "GET" and line[2] == 200 and ".distcp" in line[1]] == []
    assert all(n < files[name] for name, _, n in sent if name.endswith(".distcp")), sent
    overlaps = [(a, b) for a, b in zip(sent, sent[1:]) if a[0] == b[0] and b[1] < a[1] + a[2]]
    assert overlaps == [], overlaps
    fetched = int(result.output.rsplit("; fetched ", 1)[1].split(" bytes")[0].replace(",", ""))
    assert fetched == sum(n for _, _, n in sent) <= sum(files.values())


def test_validate_inspect_diff_load_over_http_are_the_local_ones(nginx, ds):
    import torch

    entry = ds.path(dcp_save_name(2))
    local, path = nginx.serve(entry / "dcp")
    other, other_path = nginx.serve(entry / "dcp-step2")
    url, other_url = nginx.url(path), nginx.url(other_path)

    code, on_disk = run_json("validate", local)
    remote_code, remote = run_json("validate", url)
    assert (code, remote_code) == (0, 0) and remote["valid"] and remote["findings"] == on_disk["findings"] == []
    assert remote["report_version"] == "1.1" and not list(REPORT_1_1.iter_errors(remote))
    assert remote["fetched"]["checkpoint_bytes"] == sum(sizes(local).values())
    # each byte at most once; these files are smaller than what the default reads take at once (a 64 KiB tail,
    # 16 KiB reads ahead), so validation takes each whole; with small reads, the records but not the tensors
    assert 0 < remote["fetched"]["bytes"] <= remote["fetched"]["checkpoint_bytes"]
    with pytest.MonkeyPatch.context() as patch:
        for setting, value in SMALL.items():
            patch.setattr(location.settings, setting, value)
        assert run_json("validate", url)[1]["fetched"]["bytes"] < remote["fetched"]["checkpoint_bytes"]
    text = run("validate", url + "/").output  # a directory's URL with its slash: the same checkpoint
    assert f"{url}/: valid" in text and f"{url}/: fetched " in text

    code, on_disk = run_json("inspect", local)
    remote_code, remote = run_json("inspect", url)
    assert (code, remote_code) == (0, 0)
    assert {**remote, "target": None} == {**on_disk, "target": None} and remote["kind"] == "dcp"

    code, on_disk = run_json("diff", local, other)
    remote_code, remote = run_json("diff", url, other_url)
    assert (code, remote_code) == (0, 0)
    assert remote["changes"] == on_disk["changes"] and any(c["kind"] == "values" for c in remote["changes"])
    assert run_json("diff", local, other_url)[1]["changes"] == on_disk["changes"]  # one local, one at a URL

    location.forget()
    ours, theirs = ckptspec.load_state_dict(url), ckptspec.load_state_dict(local)
    oracle = torch.load(entry / "oracle.pt", weights_only=True)["params"]
    assert sorted(ours) == sorted(theirs) == sorted(oracle)
    for name, tensor in oracle.items():
        assert torch.equal(ours[name], theirs[name]) and torch.equal(ours[name], tensor), name


def test_reshard_from_a_url_writes_the_local_output(nginx, ds, tmp_path):
    local, path = nginx.serve(ds.path(dcp_save_name(2)) / "dcp")
    for where, source in (("local", local), ("url", nginx.url(path))):
        result = run("reshard", source, tmp_path / where, "--world-size", "3", "--stage", "2")
        assert result.exit_code == 0, result.output
    assert files_of(tmp_path / "url") == files_of(tmp_path / "local")


@pytest.mark.parametrize(
    ("fault", "code", "says"),
    [
        ("missing", "CK252", "__1_0.distcp is missing"),
        ("truncated", "CK253", "items end past its"),
    ],
)
def test_a_file_missing_or_cut_short_at_the_url_has_the_local_code(fault, code, says, nginx, ds, tmp_path):
    local, path = nginx.serve(ds.path(dcp_save_name(2)) / "dcp")
    damaged = local / "__1_0.distcp"
    if fault == "missing":
        damaged.unlink()
    else:
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    url = nginx.url(path)
    for target in (local, url):
        named = f"{target}: __1_0.distcp: $.storage_data: {code} "  # the URL, as the path on disk
        result = run("validate", target)
        assert result.exit_code == 1 and named in result.output and says in result.output, result.output
        result = run("reconstruct", target, tmp_path / "out")
        assert result.exit_code == 1 and named in result.output, result.output
        assert f"{target}: not reconstructed: the checkpoint has errors; nothing was written" in result.output
        assert not (tmp_path / "out").exists()
    location.forget()
    with pytest.raises(ckptspec.CheckpointInvalid) as raised:
        ckptspec.load_state_dict(url)
    assert [f.code for f in raised.value.findings] == [code]


def test_what_a_url_cannot_take_is_refused_by_name(nginx, ds, tmp_path):
    """Options a DCP checkpoint does not take are refused at a URL as on disk, and an output at an HTTP URL is
    CK916, before anything is fetched."""
    local, path = nginx.serve(ds.path(dcp_save_name(1)) / "dcp")
    url = nginx.url(path)
    result = run("reconstruct", url, tmp_path / "out", "--dtype", "bf16")
    assert (
        result.exit_code == 2 and "--dtype other than fp32: not for a DCP checkpoint (.metadata) yet" in result.output
    )
    mark = nginx.mark()
    out_url = nginx.url("out/")  # HTTP takes no writes (an object store's URL does: test_remote_output.py)
    result = run("reconstruct", url, out_url)
    assert result.exit_code == 2 and "CK916" in result.output and "cannot be written to this URL" in result.output
    result = run("reshard", url, out_url, "--world-size", "2", "--stage", "1")
    assert result.exit_code == 2 and "CK916" in result.output, result.output
    assert [line for line in nginx.since(mark) if ".distcp" in line[1]] == []
    denied = nginx.url(path, location="denied/")
    out = tmp_path / "denied"
    for args in (("validate", denied), ("inspect", denied), ("diff", local, denied), ("reconstruct", denied, out)):
        result = run(*args)  # the URL's own code, never an internal error (CK999) or a traceback
        assert result.exit_code == 2 and "CK911" in result.output, (args, result.output)
        assert "CK999" not in result.output and not out.exists(), (args, result.output)
    location.forget()
    with pytest.raises(RemoteError) as raised:
        ckptspec.load_state_dict(denied)
    assert raised.value.code == "CK911"


def test_generate_of_a_url_is_the_local_document(nginx, s3, s3_env, ds, tmp_path):
    """``generate`` describes a DCP checkpoint at a URL as on disk: the same document byte for byte, with hashes and
    chunk digests too (over HTTP, through the index page; on S3, its listing), and it validates the local directory."""
    local = ds.path(dcp_save_name(2)) / "dcp"
    _, path = nginx.serve(local)
    for hashed in ([], ["--hash"]):
        documents = {}
        for where, source in (("local", local), ("http", nginx.url(path)), ("s3", s3.upload(local))):
            location.forget()
            out = tmp_path / f"{where}{len(hashed)}.json"
            result = run("generate", source, "-o", out, *hashed)
            assert result.exit_code == 0, (where, result.output)
            documents[where] = out.read_bytes()
        assert documents["http"] == documents["local"] == documents["s3"], hashed
        assert (b'"digest"' in documents["local"]) == bool(hashed)  # --hash: every chunk's digest, read remotely too
        result = run("validate", tmp_path / f"s3{len(hashed)}.json", "--checkpoint", local)
        assert result.exit_code == 0, result.output


def test_s3_is_the_local_checkpoint(s3, s3_env, ds, tmp_path):
    """The same commands against moto's S3 (its listing holds ``.metadata``, which an index page hides)."""
    import torch

    entry = ds.path(dcp_save_name(3))
    local = entry / "dcp"
    url = s3.upload(local)
    code, on_disk = run_json("validate", local)
    remote_code, remote = run_json("validate", url)
    assert (code, remote_code) == (0, 0) and remote["findings"] == on_disk["findings"] == []
    assert remote["fetched"]["checkpoint_bytes"] == sum(sizes(local).values())
    for where, source in (("local", local), ("s3", url)):
        result = run("reconstruct", source, tmp_path / where, "--optimizer-state")
        assert result.exit_code == 0, result.output
        result = run("reshard", source, tmp_path / f"{where}-zero", "--world-size", "2", "--stage", "1")
        assert result.exit_code == 0, result.output
    assert files_of(tmp_path / "s3") == files_of(tmp_path / "local")
    assert files_of(tmp_path / "s3-zero") == files_of(tmp_path / "local-zero")
    location.forget()
    ours = ckptspec.load_state_dict(url)
    for name, tensor in torch.load(entry / "oracle.pt", weights_only=True)["params"].items():
        assert torch.equal(ours[name], tensor), name

    damaged = tmp_path / "damaged"
    shutil.copytree(local, damaged)
    (damaged / "__2_0.distcp").unlink()
    cut = damaged / "__1_0.distcp"
    cut.write_bytes(cut.read_bytes()[:-100])
    broken = s3.upload(damaged)
    code, report = run_json("validate", broken)
    found = sorted((f["code"], f["file"]) for f in report["findings"])
    assert code == 1 and found == [("CK252", "__2_0.distcp"), ("CK253", "__1_0.distcp")], report
    result = run("reconstruct", broken, tmp_path / "out")
    assert result.exit_code == 1 and f"{broken}: __2_0.distcp: $.storage_data: CK252 " in result.output, result.output
    assert not (tmp_path / "out").exists()


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.sentinel}",)


def test_the_metadata_at_a_url_is_capped_and_never_run(nginx, ds, tmp_path, monkeypatch):
    """``.metadata`` over the pickle cap is refused (CK225) before nginx sends a byte of it; a forged one (a payload in
    its ``version``) is refused by the global's name (CK204) and the payload never runs."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    source = ds.path(dcp_save_name(2)) / "dcp"
    local, path = nginx.serve(source)
    url = nginx.url(path)
    size = (local / ".metadata").stat().st_size
    monkeypatch.setenv("CKPTSPEC_MAX_PICKLE_BYTES", str(size - 1))
    mark = nginx.mark()
    code, report = run_json("validate", url)
    assert code == 1 and report["error"]["code"] == "CK225", report
    assert f"holds {size} bytes, over the cap of {size - 1}" in report["error"]["message"]
    assert [line for line in nginx.since(mark) if line[0] == "GET" and line[1].endswith("/.metadata")] == []
    monkeypatch.delenv("CKPTSPEC_MAX_PICKLE_BYTES")

    sentinel = tmp_path / "payload-ran"
    metadata = FileSystemReader(str(source)).read_metadata()
    metadata.storage_meta = None
    metadata.version = _Payload(sentinel)
    (local / ".metadata").write_bytes(pickle.dumps(metadata))
    for args in (("validate", url), ("reconstruct", url, tmp_path / "out"), ("inspect", url)):
        result = run(*args)
        assert result.exit_code == 1, result.output
        assert "CK204" in result.output and "global posix.system, which is not allowlisted" in result.output
    location.forget()
    with pytest.raises(UnsafePickleError, match="posix.system"):
        ckptspec.load_state_dict(url)
    assert not sentinel.exists() and not (tmp_path / "out").exists()
