"""#39 (item 3): a checkpoint read through a checkpoint index (tensor/pipeline parallel, MoE, ZeRO stage 0)
at a URL is read as it is read from its local copy: the same findings, the same generated index, the same
summary, bit-identical weights; what nginx's own access log says it sent is at most the files' bytes and
no byte of a file twice; a damaged file is refused with the local code. The kind is told from the tag
directory's listing (nginx's index page, an S3 list). ``export-universal`` of a ZeRO checkpoint at a URL
writes what it writes from the local copy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

import ckptspec
from ckptspec import location
from ckptspec.checkpoint.torchfile import zip_member_locations
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind, kind_of_dir

# tensor x data parallel (ZeRO-2), a pipeline (layer files), MoE expert-parallel 2 (expert files), stage 0
NAMES = ["tp2dp2-s2-bf16-ws4", "pp2-s1-fp32-ws2", "moe-ep2-s1-fp32-ws4", "s0-bf16-ws2"]
# A 1 KiB tail, no read-ahead, 4 KiB pieces: the zip directories, pickles and tensors of these small
# files are separate reads (with the defaults the 64 KiB tail is each whole file).
SMALL = {"TAIL": 1024, "READ_AHEAD": 0, "CHUNK": 4096}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output
    return result


def run_json(*args) -> tuple[int, dict]:
    result = run(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(params=["defaults", "small"])
def reads(request, monkeypatch) -> str:
    for name, value in (SMALL if request.param == "small" else {}).items():
        monkeypatch.setattr(location.settings, name, value)
    return request.param


@pytest.fixture(scope="module")
def served(nginx, ds) -> dict[str, tuple[Path, str]]:
    """name -> (the local copy nginx serves, its URL)."""
    out = {}
    for name in NAMES:
        local, path = nginx.serve(ds.path(name))
        out[name] = (local, nginx.url(path))
    return out


def tag_files(save_dir: Path) -> dict[str, int]:
    tag = save_dir / (save_dir / "latest").read_text().strip()
    return {p.name: p.stat().st_size for p in tag.iterdir() if p.is_file()}


def sent(nginx, mark: int, files: dict[str, int], under: str | None = None) -> dict[str, int]:
    """Bytes nginx sent of each file since ``mark`` (its 200 and 206 answers), after checking that no two
    of its answers held the same byte of a file. A file is its name, or its path below ``under``."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for method, uri, status, n, rng in nginx.since(mark):
        if method == "GET" and not uri.endswith("/") and status in (200, 206):
            start = int(rng.removeprefix("bytes=").split("-")[0]) if status == 206 else 0
            name = uri.rsplit("/", 1)[-1] if under is None else uri.split(f"/{under}/", 1)[-1]
            ranges.setdefault(name, []).append((start, start + n))
    twice = {}
    for name, spans in ranges.items():
        spans.sort()
        if pairs := [(a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]:
            twice[name] = pairs
    assert twice == {}, "a byte sent twice"
    return {name: sum(b - a for a, b in ranges.get(name, [])) for name in files}


KINDS = {"tp2dp2-s2-bf16-ws4": "model_parallel", "pp2-s1-fp32-ws2": "model_parallel", "moe-ep2-s1-fp32-ws4": "moe"}
KINDS |= {"s0-bf16-ws2": "stage0", "pp2-s0-bf16-ws2": "pipeline_stage0", "s2-bf16-ws2": "zero"}


def test_the_kind_of_a_url_is_told_from_its_listing(nginx, s3, s3_env, ds):
    """``kind_of_dir`` of a tag directory at a URL, from nginx's index page and from an S3 list: the local kind."""
    for name, kind in KINDS.items():
        local = ds.path(name)
        tag = (local / "latest").read_text().strip()
        _, path = nginx.serve(local)
        for url in (nginx.url(path), s3.upload(local)):
            location.forget()
            assert kind_of_dir(location.location(f"{url}/{tag}")) is kind_of_dir(local / tag) is Kind(kind), url


@pytest.mark.parametrize("name", NAMES)
def test_validate_generate_inspect_over_http_are_the_local_ones(name, served, nginx, reads, tmp_path):
    local, url = served[name]
    files = tag_files(local)
    code, on_disk = run_json("validate", local)
    mark = nginx.mark()
    remote_code, remote = run_json("validate", url)
    got = sent(nginx, mark, files)
    assert (remote_code, remote["valid"], remote["findings"]) == (code, on_disk["valid"], on_disk["findings"])
    assert code == 0, on_disk
    assert remote["fetched"]["checkpoint_bytes"] == sum(n for f, n in files.items() if f.endswith(".pt"))
    latest = len((local / "latest").read_bytes())
    assert 0 < remote["fetched"]["bytes"] <= remote["fetched"]["checkpoint_bytes"] + latest
    assert remote["fetched"]["bytes"] == sum(got.values()) + latest
    if reads == "small":  # the zip directories, pickles and the few bytes the checks compare
        assert sum(got.values()) < 0.8 * sum(files.values()), got

    assert run("generate", local, "-o", tmp_path / "local.json").exit_code == 0
    assert run("generate", url, "-o", tmp_path / "remote.json").exit_code == 0
    generated = json.loads((tmp_path / "local.json").read_text())
    assert generated["format"] == "ckptspec.checkpoint"
    assert json.loads((tmp_path / "remote.json").read_text()) == generated

    code, summary = run_json("inspect", local)
    remote_code, remote_summary = run_json("inspect", url)
    assert (remote_code, code) == (0, 0)
    assert {**remote_summary, "target": None} == {**summary, "target": None}


@pytest.mark.parametrize("name", NAMES)
def test_reconstruct_and_load_over_http_are_the_local_ones(name, served, nginx, reads, tmp_path):
    local, url = served[name]
    files = tag_files(local)
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    mark = nginx.mark()
    result = run("reconstruct", url, tmp_path / "http")
    assert result.exit_code == 0, result.output
    got = sent(nginx, mark, files)
    written = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "http").iterdir()) and written
    for out in written:
        assert (tmp_path / "http" / out).read_bytes() == (tmp_path / "local" / out).read_bytes(), out
    assert result.stdout.rstrip().endswith(" requests") and "; fetched " in result.stdout
    counted = int(result.stdout.rsplit("; fetched ", 1)[1].split(" bytes")[0].replace(",", ""))
    assert counted == sum(got.values()) + len((local / "latest").read_bytes())
    assert sum(got.values()) <= sum(files.values())

    expected = ckptspec.load_state_dict(local, framework="numpy")
    loaded = ckptspec.load_state_dict(url, framework="numpy")
    assert list(loaded) == list(expected) and expected
    for key, array in expected.items():
        assert loaded[key].dtype == array.dtype and np.array_equal(loaded[key].view(np.uint8), array.view(np.uint8))


@pytest.mark.parametrize("name", ["tp2dp2-s2-bf16-ws4", "pp2-s1-fp32-ws2", "moe-ep2-s1-fp32-ws4"])
def test_an_index_with_hashes_checks_a_url_each_byte_once(name, served, nginx, reads, tmp_path):
    """``validate INDEX --checkpoint URL`` with the files' hashes recorded: every byte of every file,
    hashed from one read, and the findings of the local copy."""
    local, url = served[name]
    files = {f: n for f, n in tag_files(local).items() if f.endswith(".pt")}
    index = tmp_path / "index.json"
    assert run("generate", local, "-o", index, "--hash").exit_code == 0
    code, on_disk = run_json("validate", index, "--checkpoint", local)
    mark = nginx.mark()
    remote_code, remote = run_json("validate", index, "--checkpoint", url)
    got = sent(nginx, mark, files)
    assert (remote_code, remote["findings"]) == (code, on_disk["findings"]) == (0, [])
    assert got == files, (got, files)  # every byte, once
    assert remote["fetched"]["checkpoint_bytes"] == sum(files.values())


@pytest.mark.parametrize("name", ["tp2dp2-s2-bf16-ws4", "moe-ep2-s1-fp32-ws4", "s0-bf16-ws2"])
def test_a_damaged_file_at_a_url_is_refused_as_on_disk(name, nginx, ds, tmp_path):
    """A byte of a tensor flipped (the recorded hash catches it: CK209), then the file cut short, refused
    over HTTP with the codes and files of the same bytes read from disk; nothing written."""
    copy, path = nginx.serve(ds.path(name))
    url = nginx.url(path)
    index = tmp_path / "index.json"
    assert run("generate", copy, "-o", index, "--hash").exit_code == 0
    tag = copy / (copy / "latest").read_text().strip()
    damaged = max(tag.glob("*_states.pt"), key=lambda p: p.stat().st_size)  # optimizer states, or stage 0's
    tensors = [m for name, m in zip_member_locations(damaged).items() if "/data/" in name]
    offset, size = max(tensors, key=lambda m: m[1])  # the largest tensor
    data = bytearray(damaged.read_bytes())
    data[offset + size // 2] ^= 0x40
    damaged.write_bytes(bytes(data))

    code, on_disk = run_json("validate", index, "--checkpoint", copy)
    remote_code, remote = run_json("validate", index, "--checkpoint", url)
    assert code == remote_code == 1
    assert remote["findings"] == on_disk["findings"]
    assert {(f["code"], f.get("file")) for f in on_disk["findings"]} == {("CK209", damaged.name)}
    for where, out in ((copy, tmp_path / "local"), (url, tmp_path / "http")):
        result = run("reconstruct", where, out, "--manifest", index)
        assert result.exit_code == 1 and "CK209" in result.output, result.output
        assert not out.exists()

    damaged.write_bytes(bytes(data[: len(data) // 2]))  # cut short: its zip directory is gone
    code, on_disk = run_json("validate", copy)
    remote_code, remote = run_json("validate", url)
    assert code == remote_code == 1
    assert remote["findings"] == on_disk["findings"]
    if on_disk["findings"]:
        assert damaged.name in {f.get("file") for f in on_disk["findings"]}, on_disk
    else:  # a file that cannot be read at all: the same error, naming the same file (by its URL)
        assert remote["error"] == on_disk["error"] and on_disk["error"]["code"] == "CK205"
        line = run("validate", copy).stderr.strip()
        assert line.startswith(f"{damaged}: CK205 ")
        assert run("validate", url).stderr.strip() == line.replace(str(copy), url, 1)


@pytest.mark.parametrize("name", ["tp2dp2-s2-bf16-ws4", "moe-ep2-s1-fp32-ws4"])
def test_index_kinds_over_s3_are_the_local_ones(name, s3, s3_env, ds, tmp_path):
    local = ds.path(name)
    url = s3.upload(local)
    code, on_disk = run_json("validate", local)
    remote_code, remote = run_json("validate", url)
    assert (remote_code, remote["findings"]) == (code, on_disk["findings"]) == (0, [])
    assert (
        0 < remote["fetched"]["bytes"] <= remote["fetched"]["checkpoint_bytes"] + len((local / "latest").read_bytes())
    )
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    assert run("reconstruct", url, tmp_path / "s3", "--quiet").exit_code == 0
    written = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "s3").iterdir()) and written
    for out in written:
        assert (tmp_path / "s3" / out).read_bytes() == (tmp_path / "local" / out).read_bytes(), out


def test_export_universal_from_a_url_is_the_local_export(nginx, tmp_path):
    local, path = nginx.serve(COMMITTED["s2-bf16-ws2"])
    assert run("export-universal", local, tmp_path / "local").exit_code == 0
    result = run("export-universal", nginx.url(path), tmp_path / "remote")
    assert result.exit_code == 0, result.output
    files = sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "remote") for p in (tmp_path / "remote").rglob("*") if p.is_file())
    assert len(files) > 2
    for rel in files:
        assert (tmp_path / "remote" / rel).read_bytes() == (tmp_path / "local" / rel).read_bytes(), rel


@pytest.mark.parametrize("name", ["tp2dp2-s2-bf16-ws4", "pp2-s1-fp32-ws2", "moe-ep2-s1-fp32-ws4", "s0-bf16-ws2"])
def test_reconstruct_with_a_hashed_index_fetches_each_byte_once(name, served, nginx, reads, tmp_path):
    """``reconstruct URL --manifest INDEX`` (and ``load_state_dict``) with the files' hashes recorded: the
    reader checks them from the bytes it reads (validation leaves them to it), so every byte of every file is
    sent exactly once, and the output is the local one."""
    local, url = served[name]
    files = {f: n for f, n in tag_files(local).items() if f.endswith(".pt")}
    index = tmp_path / "index.json"
    assert run("generate", local, "-o", index, "--hash").exit_code == 0
    assert run("reconstruct", local, tmp_path / "local", "--manifest", index, "--quiet").exit_code == 0
    mark = nginx.mark()
    result = run("reconstruct", url, tmp_path / "http", "--manifest", index)
    assert result.exit_code == 0, result.output
    assert sent(nginx, mark, files) == files  # every byte, once
    written = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "http").iterdir()) and written
    for out in written:
        assert (tmp_path / "http" / out).read_bytes() == (tmp_path / "local" / out).read_bytes(), out

    location.forget()  # nothing kept from the command above
    mark = nginx.mark()
    loaded = ckptspec.load_state_dict(url, framework="numpy", manifest=index)
    assert sent(nginx, mark, files) == files
    expected = ckptspec.load_state_dict(local, framework="numpy", manifest=index)
    assert list(loaded) == list(expected) and expected
    for key, array in expected.items():
        assert np.array_equal(loaded[key].view(np.uint8), array.view(np.uint8)), key


@pytest.mark.parametrize("name", ["uc-s2-bf16-ws2", "uc-s3-bf16-ws2"])
def test_a_universal_folder_over_http_is_the_local_one(name, nginx, ds, reads, tmp_path):
    """A ``ds_to_universal`` folder (a directory per parameter) at a URL: the kind from nginx's listings, the
    findings, the generated index and the weights of its local copy, each byte of its files sent at most once."""
    copy, path = nginx.serve(ds.path(name))
    folder = json.loads((copy / "parallel.json").read_text())["universal"]["output_folder"]
    local, url = copy / folder, f"{nginx.url(path)}/{folder}"
    location.forget()
    assert kind_of_dir(location.location(url)) is kind_of_dir(local) is Kind.UNIVERSAL
    files = {str(p.relative_to(local)): p.stat().st_size for p in local.rglob("*.pt")}
    code, on_disk = run_json("validate", local)
    remote_code, remote = run_json("validate", url)
    assert (remote_code, remote["findings"]) == (code, on_disk["findings"]) and code == 0, on_disk
    assert run("generate", local, "-o", tmp_path / "local.json").exit_code == 0
    assert run("generate", url, "-o", tmp_path / "remote.json").exit_code == 0
    assert json.loads((tmp_path / "remote.json").read_text()) == json.loads((tmp_path / "local.json").read_text())

    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    mark = nginx.mark()
    result = run("reconstruct", url, tmp_path / "http")
    assert result.exit_code == 0, result.output
    got = sent(nginx, mark, files, under=folder)
    assert 0 < sum(got.values()) <= sum(files.values())
    written = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "http").iterdir()) and written
    for out in written:
        assert (tmp_path / "http" / out).read_bytes() == (tmp_path / "local" / out).read_bytes(), out


@pytest.mark.parametrize("name", ["uc-s2-bf16-ws2", "uc-s3-bf16-ws2"])
def test_the_optimizer_state_of_a_universal_folder_over_http_is_the_local_one(name, nginx, ds, tmp_path):
    """``reconstruct --optimizer-state`` of a ``ds_to_universal`` folder at a URL: its moments, step and
    hyperparameters (``zero/<param>/<state>.pt``, ``zero/optimizer_state.pt``) read over HTTP, byte for byte the
    local export (tests/export/test_universal_optimizer_state.py holds that one against DeepSpeed)."""
    copy, path = nginx.serve(ds.path(name))
    folder = json.loads((copy / "parallel.json").read_text())["universal"]["output_folder"]
    assert run("reconstruct", copy / folder, tmp_path / "local", "--quiet", "--optimizer-state").exit_code == 0
    result = run("reconstruct", f"{nginx.url(path)}/{folder}", tmp_path / "http", "--quiet", "--optimizer-state")
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert "optimizer.safetensors" in written and written == sorted(p.name for p in (tmp_path / "http").iterdir())
    for out in written:
        assert (tmp_path / "http" / out).read_bytes() == (tmp_path / "local" / out).read_bytes(), out
