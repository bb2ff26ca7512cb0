"""#37 (M2): URLs where a command used to fail inside ckptspec (CK999, a TypeError on ``RemotePath``).
A checkpoint read through a checkpoint index (tensor/pipeline parallel, MoE, ZeRO stage 0, universal)
is refused from a URL by name (CK202, docs/remote.md), before anything is fetched; ``export-universal``
of a ZeRO checkpoint at a URL works, and writes what it writes from the local copy."""

from __future__ import annotations

import json

import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.errors import UnsupportedCheckpoint


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output
    return result


@pytest.mark.parametrize("name", ["tp2-s1-fp32-ws2", "moe-ep2-s1-fp32-ws4"])
def test_an_index_kind_at_a_url_is_refused_by_name(name, nginx, ds, tmp_path):
    local, path = nginx.serve(ds.path(name))
    url = nginx.url(path)
    index = tmp_path / "index.json"
    assert run("generate", local, "-o", index).exit_code == 0

    mark = nginx.mark()
    checked = run("validate", index, "--checkpoint", url, "--format", "json")
    assert checked.exit_code == 1, checked.output
    report = json.loads(checked.stdout)
    assert report["error"]["code"] == "CK202" and "local directory only" in report["error"]["message"]
    assert report["fetched"] == {"bytes": 0, "requests": 0}

    out = tmp_path / "out"
    result = run("reconstruct", url, out, "--manifest", index)
    assert result.exit_code == 1, result.output
    assert f"{url}: CK202 " in result.output and "local directory only" in result.output
    assert not out.exists()
    with pytest.raises(UnsupportedCheckpoint, match="local directory only"):
        ckptspec.load_state_dict(url, manifest=index)
    assert nginx.since(mark) == [], "refused before anything is fetched"


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
