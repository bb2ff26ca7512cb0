"""The fault corpus (tests/_harness/faults.py) served by nginx: every corruption is refused over
HTTP exactly as on disk (the same findings, or the same error), pickled code never runs, and a
reconstruction from the URL writes nothing."""

from __future__ import annotations

import json

import pytest
from _harness.faults import FAULTS, FaultEnv, base_dir, snapshot
from _harness.faults_copies import COPIES_INDEX_FAULTS
from _harness.faults_masters import MASTERS_FAULTS
from _harness.faults_parallel import PARALLEL_FAULTS
from click.testing import CliRunner

from ckptspec.cli import cli

# The ones the issue names; the others are checked by validation only (the same readers run).
RECONSTRUCTED = {"truncated-shard", "missing-rank", "swapped-rank-files", "malicious-pickle"}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def verdict(*args) -> tuple[int, dict]:
    result = run(*args, "--format", "json")
    report = json.loads(result.stdout)
    return result.exit_code, {k: report.get(k) for k in ("valid", "findings", "error")}


@pytest.fixture(scope="module")
def built(ds):
    return lambda base: base_dir(base, lambda: ds)


# The faults of checkpoint indexes (#16) run on local directories here; their URLs: test_remote_index.py.
INDEX_FAULTS = PARALLEL_FAULTS + MASTERS_FAULTS + COPIES_INDEX_FAULTS
ZERO_FAULTS = [f for f in FAULTS if f not in INDEX_FAULTS]


@pytest.mark.parametrize("fault", ZERO_FAULTS, ids=lambda f: f.name)
def test_fault_is_refused_over_http_as_on_disk(fault, built, nginx, tmp_path):
    local, path = nginx.serve(built(fault.base))
    url = nginx.url(path)
    args_local, args_url = [local], [url]
    if fault.hashed_manifest:
        manifest = tmp_path / "manifest.json"
        assert run("generate", local, "--hash", "-o", manifest).exit_code == 0
        if fault.digests_only:
            doc = json.loads(manifest.read_text())
            for f in doc["files"]:
                del f["hash"]
            manifest.write_text(json.dumps(doc))
        args_local, args_url = [manifest, "--checkpoint", local], [manifest, "--checkpoint", url]
    env = FaultEnv(built(fault.donor) if fault.donor else None, tmp_path / "pwned")
    fault.mutate(local, env)
    before = snapshot(local)

    on_disk = verdict("validate", *args_local)
    over_http = verdict("validate", *args_url)
    assert on_disk[0] == (1 if fault.severity == "error" else 0)
    assert fault.code in json.dumps(on_disk[1])
    if fault.name == "leftover-temporary":
        # nginx's index pages never list dot files, so a leftover temporary (a warning) is not
        # seen over HTTP (docs/remote.md); everything else is the same.
        on_disk[1]["findings"] = [f for f in on_disk[1]["findings"] if f["code"] != "CK224"]
    assert over_http == on_disk
    assert not env.marker.exists(), "pickled code ran"

    if fault.name in RECONSTRUCTED:
        out = tmp_path / "out"
        result = run("reconstruct", url, out, *(["--manifest", args_url[0]] if fault.hashed_manifest else []))
        # reconstruct checks tensor digests (CK222) as it reads the tensors and, over a URL, the files'
        # hashes (CK209) too (each byte is fetched once): a fault that other checks see as well is
        # refused by those, before any tensor is read; one only a hash sees, by it (test_fetch_once.py).
        errors = {f["code"] for f in on_disk[1]["findings"] if f["severity"] == "error"}
        named = errors - {"CK209", "CK222"} or {fault.code}
        assert result.exit_code == 1 and all(code in result.output for code in named), (named, result.output)
        assert not out.exists() or not any(out.iterdir()), "a refused reconstruction wrote files"
        assert not env.marker.exists(), "pickled code ran"
    assert snapshot(local) == before


def test_a_tensor_parallel_checkpoint_over_http_is_read_as_its_index(built, nginx, tmp_path):
    """Read locally it is a checkpoint index (#16); from a URL too (#39): the same verdict and weights."""
    local, path = nginx.serve(built("tp2-s1-fp32-ws2"))
    assert run("validate", local).exit_code == 0
    result = run("validate", nginx.url(path))
    assert result.exit_code == 0 and result.output.startswith(f"{nginx.url(path)}: valid"), result.output
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    assert run("reconstruct", nginx.url(path), tmp_path / "http", "--quiet").exit_code == 0
    for out in (tmp_path / "local").iterdir():
        assert (tmp_path / "http" / out.name).read_bytes() == out.read_bytes(), out.name
