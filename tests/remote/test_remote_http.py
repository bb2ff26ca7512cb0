"""Every command on checkpoints served by a real nginx (HTTP range requests), against the same
command on the local copy: same findings, same manifests, bit-identical weights; what was fetched
is what nginx's own access log says it sent, and validation asks for no tensor bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from ckptspec import location
from ckptspec.checkpoint.torchfile import zip_member_locations
from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
REPORT_1_1 = Draft202012Validator(json.loads((ROOT / "schema" / "report-1.1.schema.json").read_text("utf-8")))


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def run_json(*args) -> tuple[int, dict]:
    result = run(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


def tag_of(save_dir: Path) -> str:
    return (save_dir / "latest").read_text().strip()


@pytest.fixture(scope="module")
def served(nginx, ds):
    """(local save directory, its URL on nginx) for a ZeRO-2 and a ZeRO-3 checkpoint."""
    out = {}
    for name in ("s2-bf16-ws2", "s3-bf16-ws2-sub"):
        local, path = nginx.serve(ds.path(name))
        out[name] = (local, nginx.url(path))
    return out


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-bf16-ws2-sub"])
def test_validate_over_http_is_validate_on_disk(name, served, nginx):
    local, url = served[name]
    code, on_disk = run_json("validate", local)
    mark = nginx.mark()
    remote_code, remote = run_json("validate", url, "--no-hash")
    assert (code, remote_code) == (0, 0) and on_disk["valid"] and remote["valid"]
    assert remote["findings"] == on_disk["findings"] == []
    assert remote["report_version"] == "1.1" and on_disk["report_version"] == "1.0"
    assert not list(REPORT_1_1.iter_errors(remote)) and not list(REPORT_1_1.iter_errors(on_disk))
    # What ckptspec counted is what nginx sent in answer to range requests.
    sent = sum(n for _, _, status, n, _ in nginx.since(mark) if status == 206)
    files = sorted((local / tag_of(local)).glob("*.pt"))
    assert remote["fetched"]["bytes"] == sent > 0
    assert remote["fetched"]["checkpoint_bytes"] == sum(p.stat().st_size for p in files)
    per_file: dict[str, int] = {}
    for _, uri, status, n, _ in nginx.since(mark):
        if status == 206:
            per_file[uri] = per_file.get(uri, 0) + n
    for uri, n in per_file.items():  # small files: no byte of any of them is fetched twice
        assert n <= (local / uri.split("/", 2)[2]).stat().st_size, uri

    text = run("validate", url, "--no-hash")
    assert text.exit_code == 0
    assert text.stdout.splitlines()[0] == f"{url}: valid"
    assert text.stdout.splitlines()[1].startswith(f"{url}: fetched ")


def test_validation_asks_for_no_tensor_bytes(served, nginx, monkeypatch):
    """With no read-ahead and a small tail, the ranges validation asks nginx for are the zip
    directories, the local headers and data.pkl: the only tensor bytes asked for are the
    one-element tensors format 1.1 reads by design (optimizer steps, loss scale) and the few elements
    CK235 samples of the masters and of the module's copies (at most 4 elements, 16 bytes, a read)."""
    monkeypatch.setattr(location.settings, "TAIL", 1024)
    monkeypatch.setattr(location.settings, "READ_AHEAD", 0)
    local, url = served["s2-bf16-ws2"]
    mark = nginx.mark()
    assert run("validate", url, "--no-hash").exit_code == 0
    tag = tag_of(local)
    asked: dict[str, list[tuple[int, int]]] = {}
    for _, uri, status, _, rng in nginx.since(mark):
        if status == 206:
            start, end = rng.removeprefix("bytes=").split("-")
            asked.setdefault(uri.rsplit("/", 1)[-1], []).append((int(start), int(end) + 1))
    assert asked.pop("latest") == [(0, len(tag))]  # the tag it names, no more
    assert set(asked) == {p.name for p in (local / tag).glob("*.pt")}
    scalars = 0
    for name, ranges in asked.items():
        size = (local / tag / name).stat().st_size
        assert sum(b - a for a, b in ranges) < size, name
        tensors = [
            (o, o + n) for member, (o, n) in zip_member_locations(local / tag / name).items() if "/data/" in member
        ]
        assert tensors, name
        tail = [r for r in ranges if r[1] == size]
        assert len(tail) == 1, (name, ranges)  # the end record and central directory: once
        overlap = [(r, t) for r in ranges if r not in tail for t in tensors if r[0] < t[1] and t[0] < r[1]]
        assert all(t[0] <= r[0] and r[1] <= t[1] for r, t in overlap), (name, overlap)  # no read spans tensors
        assert all(t[1] - t[0] <= 8 or r[1] - r[0] <= 16 for r, t in overlap), (name, overlap)  # scalars, samples
        scalars += sum(1 for r, t in overlap if t[1] - t[0] <= 8)
    assert scalars > 0  # the steps of the optimizer files were read (CK223), from their bytes


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-bf16-ws2-sub"])
def test_reconstruct_over_http_is_bit_identical(name, served, tmp_path):
    local, url = served[name]
    assert run("reconstruct", local, tmp_path / "local", "--quiet", "--optimizer-state").exit_code == 0
    assert (tmp_path / "local" / "optimizer.safetensors").exists()
    result = run("reconstruct", url, tmp_path / "http", "--optimizer-state")
    assert result.exit_code == 0, result.output
    assert "; fetched " in result.stdout
    for out in (tmp_path / "local").iterdir():
        assert (tmp_path / "http" / out.name).read_bytes() == out.read_bytes(), out.name
    assert sorted(p.name for p in (tmp_path / "http").iterdir()) == sorted(
        p.name for p in (tmp_path / "local").iterdir()
    )

    import ckptspec

    location.forget()
    ours = ckptspec.load_state_dict(url, framework="numpy")
    theirs = ckptspec.load_state_dict(local, framework="numpy")
    assert list(ours) == list(theirs)
    assert all(np.array_equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in ours)


def test_bf16_output_and_torch_format_over_http(served, tmp_path):
    """Dtype conversion and torch.save output read the remote bytes through the same planned stream."""
    local, url = served["s2-bf16-ws2"]
    for args in (["--dtype", "bf16"], ["--format", "torch"]):
        assert run("reconstruct", local, tmp_path / f"local{args[1]}", "--quiet", *args).exit_code == 0
        result = run("reconstruct", url, tmp_path / f"http{args[1]}", "--quiet", *args)
        assert result.exit_code == 0, result.output
        for out in (tmp_path / f"local{args[1]}").iterdir():
            if out.suffix == ".safetensors":
                assert (tmp_path / f"http{args[1]}" / out.name).read_bytes() == out.read_bytes()
    import torch

    a = torch.load(tmp_path / "localtorch" / "pytorch_model.bin", weights_only=True)
    b = torch.load(tmp_path / "httptorch" / "pytorch_model.bin", weights_only=True)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_generate_inspect_diff_extract_over_http(served, tmp_path, nginx):
    local, url = served["s2-bf16-ws2"]
    assert run("generate", local, "-o", tmp_path / "local.json").exit_code == 0
    assert run("generate", url, "-o", tmp_path / "http.json").exit_code == 0
    assert json.loads((tmp_path / "http.json").read_text()) == json.loads((tmp_path / "local.json").read_text())

    code, shown = run_json("inspect", url)
    local_code, local_shown = run_json("inspect", local)
    assert code == local_code == 0
    assert {k: v for k, v in shown.items() if k != "target"} == {k: v for k, v in local_shown.items() if k != "target"}

    result = run("diff", local, url, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resume"]["ok"] is True

    # A manifest served over HTTP: validated alone, against the remote files, and used to reconstruct.
    (nginx.root / "manifests").mkdir(exist_ok=True)
    (nginx.root / "manifests" / f"{tmp_path.name}.json").write_bytes((tmp_path / "local.json").read_bytes())
    manifest_url = nginx.url(f"manifests/{tmp_path.name}.json")
    code, report = run_json("validate", manifest_url)
    assert code == 0 and report["valid"] and report["fetched"]["bytes"] == (tmp_path / "local.json").stat().st_size
    assert run("validate", manifest_url, "--checkpoint", url).exit_code == 0
    result = run("reconstruct", url, tmp_path / "out", "--manifest", manifest_url, "--quiet")
    assert result.exit_code == 0, result.output

    # A checkpoint that carries its manifest: extract prints the same copy from either place.
    embedded = tmp_path / "embedded"
    shutil.copytree(local, embedded)
    assert run("embed", embedded, "--no-hash").exit_code == 0
    _, embedded_path = nginx.serve(embedded)
    here, there = run("extract", embedded), run("extract", nginx.url(embedded_path))
    assert here.exit_code == there.exit_code == 0
    assert json.loads(there.stdout) == json.loads(here.stdout)
    code, report = run_json("validate", nginx.url(embedded_path))
    assert code == 0 and report["findings"] == []


def test_hashes_are_verified_over_http(served, tmp_path, nginx):
    """Hashes recorded in a manifest are checked against every byte fetched (the one case where
    whole files are read), and bit rot is found as on disk."""
    local, url = served["s2-bf16-ws2"]
    manifest = tmp_path / "m.json"
    assert run("generate", local, "--hash", "-o", manifest).exit_code == 0
    code, report = run_json("validate", manifest, "--checkpoint", url)
    assert code == 0, report
    total = report["fetched"]["checkpoint_bytes"]
    assert report["fetched"]["bytes"] >= total

    rotten, rotten_path = nginx.serve(local)
    victim = rotten / tag_of(local) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    code, report = run_json("validate", manifest, "--checkpoint", nginx.url(rotten_path))
    local_code, on_disk = run_json("validate", manifest, "--checkpoint", rotten)
    assert code == local_code == 1
    assert report["findings"] == on_disk["findings"]
    assert ("CK209", victim.name) in [(f["code"], f.get("file")) for f in report["findings"]], report


def test_writes_to_urls_are_refused(served, tmp_path):
    local, url = served["s2-bf16-ws2"]
    for args in (
        ["embed", url],
        ["embed", url, "--sidecar-only"],
        ["reconstruct", local, "https://example.invalid/out"],  # HTTP: read-only (object stores take outputs)
        ["reshard", local, url + "-out", "--world-size", "2"],
        ["generate", local, "-o", "https://example.invalid/manifest.json"],
    ):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "CK916" in result.output and "read-only" in result.output, result.output
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()
