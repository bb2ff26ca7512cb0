"""A command reading a checkpoint over HTTP fetches each byte of it at most once (issue #37, L10).

Checkpoints that carry their manifest (a sidecar with file hashes and 1.1 tensor digests, written
by ``ckptspec embed`` and by the save hook), served by a real nginx; what was fetched is what
nginx's own access log says it sent: the byte ranges of its 206 answers, file by file. Before the
fix a validation with hashes fetched each file twice and each tensor once more (330% of the files
in 95 requests), ``--no-hash`` the sidecar twice, and ``reconstruct`` every file twice.

``small`` reads with a 1 KiB tail, no read-ahead and 4 KiB pieces, so that the zip directory, the
pickles and the tensors of these small files are separate reads (with the defaults the 64 KiB
tail is each whole file).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec import location
from ckptspec.cli import cli

READS = {"defaults": {}, "small": {"TAIL": 1024, "READ_AHEAD": 0, "CHUNK": 4096}}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


@pytest.fixture(params=sorted(READS))
def reads(request, monkeypatch) -> str:
    for name, value in READS[request.param].items():
        monkeypatch.setattr(location.settings, name, value)
    return request.param


@pytest.fixture(scope="module")
def sidecars(nginx, ds, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """(local save directory, its URL): a real ZeRO-2 checkpoint embedded with hashes, the same
    embedded without, and a ZeRO-3 checkpoint saved through the save hook (a master's digest
    covers a fragment in every rank's file)."""
    out = {}
    for name, source, args in (
        ("embed", "s2-bf16-ws2", []),
        ("embed-no-hash", "s2-bf16-ws2", ["--no-hash"]),
        ("hook", "embed-s3-fp16-ws2-groups-sub", None),
    ):
        local = tmp_path_factory.mktemp(name) / "ckpt"
        shutil.copytree(ds.path(source), local)
        if args is not None:
            assert run("embed", local, *args).exit_code == 0
        copy, path = nginx.serve(local)
        out[name] = (copy, nginx.url(path))
    return out


def tag_files(save_dir: Path) -> dict[str, int]:
    """Every file of the tag directory (the sidecar included): name -> size."""
    tag = save_dir / (save_dir / "latest").read_text().strip()
    return {p.name: p.stat().st_size for p in tag.iterdir() if p.is_file()}


def sent_ranges(nginx, mark: int) -> dict[str, list[tuple[int, int]]]:
    """name -> the [start, end) byte ranges nginx sent of that file, in order; a file sent whole
    (200) is [0, bytes)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for method, uri, status, sent, rng in nginx.since(mark):
        if method != "GET" or uri.endswith("/") or status not in (200, 206):
            continue  # index pages (listings), HEADs, redirects
        start = int(rng.removeprefix("bytes=").split("-")[0]) if status == 206 else 0
        out.setdefault(uri.rsplit("/", 1)[-1], []).append((start, start + sent))
    return out


def twice(ranges: list[tuple[int, int]]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs of ranges that share a byte."""
    ordered = sorted(ranges)
    return [(a, b) for a, b in zip(ordered, ordered[1:]) if b[0] < a[1]]


def fetched(nginx, mark: int, files: dict[str, int]) -> dict[str, int]:
    """Bytes sent of each file of ``files``, after checking that no byte of any file was sent twice."""
    ranges = sent_ranges(nginx, mark)
    assert {name: twice(r) for name, r in ranges.items() if twice(r)} == {}
    return {name: sum(b - a for a, b in ranges.get(name, [])) for name in files}


@pytest.mark.parametrize("name", ["embed", "hook"])
def test_validate_with_hashes_fetches_each_byte_once(name, sidecars, nginx, reads):
    local, url = sidecars[name]
    files = tag_files(local)
    mark = nginx.mark()
    result = run("validate", url)
    assert result.exit_code == 0 and result.stdout.startswith(f"{url}: valid"), result.output
    got = fetched(nginx, mark, files)
    # The hashes need every byte of every file, the sidecar is read once: exactly 1.0x.
    assert got == files, (got, files)
    requests = [r for r in nginx.since(mark) if r[2] == 206 and not r[1].endswith("/latest")]
    if reads == "defaults":  # one per file (each is smaller than the 64 KiB tail), not one per tensor
        assert len(requests) == len(files), requests


@pytest.mark.parametrize("name", ["embed", "hook"])
def test_validate_no_hash_fetches_metadata_once(name, sidecars, nginx, reads):
    local, url = sidecars[name]
    files = tag_files(local)
    mark = nginx.mark()
    assert run("validate", url, "--no-hash").exit_code == 0
    got = fetched(nginx, mark, files)
    sidecar = next(n for n in files if n.startswith("ckptspec."))
    assert got[sidecar] == files[sidecar]  # once
    if reads == "small":  # zip directories, pickles and headers: well under the files' bytes
        pt = [n for n in files if n.endswith(".pt")]
        assert sum(got[n] for n in pt) < 0.6 * sum(files[n] for n in pt), got


@pytest.mark.parametrize("name", ["embed", "embed-no-hash", "hook"])
def test_reconstruct_fetches_each_byte_once(name, sidecars, nginx, reads, tmp_path):
    local, url = sidecars[name]
    files = tag_files(local)
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    mark = nginx.mark()
    result = run("reconstruct", url, tmp_path / "http", "--quiet")
    assert result.exit_code == 0, result.output
    for out in (tmp_path / "local").iterdir():
        assert (tmp_path / "http" / out.name).read_bytes() == out.read_bytes(), out.name
    got = fetched(nginx, mark, files)
    pt = [n for n in files if n.endswith(".pt")]
    if name == "embed-no-hash":  # no file hash to verify: the metadata and the masters only
        if reads == "small":
            assert sum(got[n] for n in pt) < 0.9 * sum(files[n] for n in pt), got
    else:  # the recorded hashes are verified: every byte of every file, once
        assert got == files, (got, files)


def test_reconstruct_verifies_bytes_it_does_not_write(sidecars, nginx, tmp_path, reads):
    """A byte flipped where reconstruct takes nothing (an Adam moment) is still found by the file's
    hash, computed from the bytes fetched once, before anything is written (CK209, exit 1)."""
    local, _ = sidecars["embed"]
    rotten, rotten_path = nginx.serve(local)
    tag = (rotten / "latest").read_text().strip()
    victim = rotten / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sidecar = json.loads((rotten / tag / "ckptspec.json").read_text())
    entry = next(f for f in sidecar["files"] if f["path"] == victim.name)
    moment = next(loc for loc in entry["state_partitions"] if loc["state"] == "exp_avg_sq")
    data = bytearray(victim.read_bytes())
    data[moment["data_offset"] + 4] ^= 0x10  # an element of exp_avg_sq: no weight is made from it
    victim.write_bytes(bytes(data))
    local_result = run("reconstruct", rotten, tmp_path / "local", "--quiet")
    result = run("reconstruct", nginx.url(rotten_path), tmp_path / "http", "--quiet")
    assert result.exit_code == local_result.exit_code == 1, result.output
    assert "CK209" in result.output and victim.name in result.output, result.output
    assert "CK209" in local_result.output
    assert not (tmp_path / "http").exists() or not list((tmp_path / "http").iterdir())


def test_without_kept_bytes_the_answers_are_the_same(sidecars, nginx, tmp_path, monkeypatch):
    """The kept bytes only save requests: with a budget too small to keep anything, the bytes a
    hash needs out of order are fetched again, and the verdict and the weights are the same."""
    for name, value in {**READS["small"], "KEPT_BYTES": 16}.items():
        monkeypatch.setattr(location.settings, name, value)
    local, url = sidecars["hook"]
    files = tag_files(local)
    mark = nginx.mark()
    assert run("validate", url).stdout.startswith(f"{url}: valid")
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    assert run("reconstruct", url, tmp_path / "http", "--quiet").exit_code == 0
    for out in (tmp_path / "local").iterdir():
        assert (tmp_path / "http" / out.name).read_bytes() == out.read_bytes(), out.name
    sent = sum(b - a for spans in sent_ranges(nginx, mark).values() for a, b in spans)
    assert sent > 2 * sum(files.values())  # every byte twice at least (two hashing runs), some more


def test_kept_bytes_stay_within_their_budget():
    kept = location.kept.Kept(budget=100)
    for start in range(0, 1000, 40):
        kept.keep("f", start, bytes(40))
    spans = kept.overlapping("f", 0, 1000)
    assert sum(len(d) for _, d in spans) <= 100 and [s for s, _ in spans] == [920, 960]
    kept.keep("f", 0, bytes(101))  # larger than the budget: not kept, nothing dropped for it
    assert kept.overlapping("f", 0, 101) == [] and len(kept.overlapping("f", 0, 1000)) == 2
    assert location.kept.parts(spans, 900, 1010) == [
        (900, 920, None),
        (920, 960, memoryview(bytes(40))),
        (960, 1000, memoryview(bytes(40))),
        (1000, 1010, None),
    ]


@pytest.mark.parametrize("name", ["embed", "hook"])
def test_load_optimizer_state_fetches_each_byte_once(name, sidecars, nginx, reads):
    """Review: `load_optimizer_state` validated with hashes (every byte), then read the moments again."""
    import numpy as np

    import ckptspec

    local, url = sidecars[name]
    files = tag_files(local)
    want, _ = ckptspec.load_optimizer_state(local)
    location.forget()  # a library caller's earlier reads (another case's) are not this call's
    mark = nginx.mark()
    got_state, _ = ckptspec.load_optimizer_state(url)
    assert got_state.keys() == want.keys()
    assert all(np.array_equal(got_state[p][k], v) for p in want for k, v in want[p].items())
    got = fetched(nginx, mark, files)
    assert got == files, (got, files)  # the recorded hashes are verified: every byte, once
