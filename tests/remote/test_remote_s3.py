"""The same commands against moto's S3 server, read through s3fs exactly as against AWS: the
endpoint and credentials come from the environment a user would set (``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``...), never from flags."""

from __future__ import annotations

import json

import pytest
from _harness.servers import upload
from click.testing import CliRunner

from ckptspec.cli import cli

pytestmark = pytest.mark.deepspeed


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def run_json(*args) -> tuple[int, dict]:
    result = run(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def uploaded(s3, ds):
    """(local save directory, its s3:// URL) of a real ZeRO-2 checkpoint."""
    local = ds.path("s2-bf16-ws2")
    return local, upload(s3, local)


def test_validate_on_s3_is_validate_on_disk(uploaded, s3_env):
    local, url = uploaded
    code, on_disk = run_json("validate", local)
    remote_code, remote = run_json("validate", url, "--no-hash")
    assert (code, remote_code) == (0, 0)
    assert remote["findings"] == on_disk["findings"] == [] and remote["valid"]
    tag = (local / "latest").read_text().strip()
    sizes = sum(p.stat().st_size for p in (local / tag).glob("*.pt"))
    assert remote["fetched"]["checkpoint_bytes"] == sizes
    assert 0 < remote["fetched"]["bytes"] <= sizes + len(tag)  # no byte fetched twice


def test_reconstruct_generate_diff_on_s3(uploaded, s3_env, tmp_path):
    local, url = uploaded
    assert run("reconstruct", local, tmp_path / "local", "--quiet").exit_code == 0
    result = run("reconstruct", url, tmp_path / "s3")
    assert result.exit_code == 0, result.output
    assert "; fetched " in result.stdout
    outputs = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert sorted(p.name for p in (tmp_path / "s3").iterdir()) == outputs
    for name in outputs:
        assert (tmp_path / "s3" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name

    assert run("generate", local, "-o", tmp_path / "local.json").exit_code == 0
    assert run("generate", url, "-o", tmp_path / "s3.json").exit_code == 0
    assert json.loads((tmp_path / "s3.json").read_text()) == json.loads((tmp_path / "local.json").read_text())
    result = run("diff", local, url, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resume"]["ok"] is True


def test_s3_not_found_has_a_code(uploaded, s3_env, tmp_path):
    _, url = uploaded
    missing = url.rsplit("/", 1)[0] + "/no-such-checkpoint"
    code, report = run_json("validate", missing)
    assert code == 2 and report["error"]["code"] == "CK910", report
    result = run("reconstruct", missing, tmp_path / "out")
    assert result.exit_code == 2 and "CK910" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
