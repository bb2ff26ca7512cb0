"""The same commands against moto's S3 server, read through s3fs exactly as against AWS: the
endpoint and credentials come from the environment a user would set (``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``...), never from flags."""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError
from click.testing import CliRunner

from ckptspec import location
from ckptspec.cli import cli


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
    return local, s3.upload(local)


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


@pytest.mark.parametrize("change", ["grown", "same-size"])
def test_object_changed_while_read_writes_nothing(change, s3, s3_env, ds, monkeypatch, tmp_path):
    """The object is overwritten between validation (which saw its size and ETag) and the reads of
    its tensors: s3fs pins every range read with If-Match, moto answers 412, CK913, nothing written.
    (A small tail: else this small file is fetched whole by validation, kept, and not fetched again.)"""
    monkeypatch.setattr(location.settings, "TAIL", 2048)
    monkeypatch.setattr(location.settings, "READ_AHEAD", 0)
    local = ds.path("s2-bf16-ws2")
    url = s3.upload(local)
    tag = (local / "latest").read_text().strip()
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    key = f"{url.removeprefix('s3://')}/{tag}/{name}"
    from ckptspec.export import writers

    original = writers.write_consolidated

    def overwrite_then_write(*args, **kwargs):
        data = (local / tag / name).read_bytes()
        s3.filesystem().pipe_file(key, data + b"\0" * 4096 if change == "grown" else data[::-1])
        return original(*args, **kwargs)

    monkeypatch.setattr(writers, "write_consolidated", overwrite_then_write)
    result = run("reconstruct", url, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "CK913" in result.output and name in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# moto enforces IAM once this many requests were served: its own health check (start_s3), then the
# four that set the locked bucket up below; every request after them is authenticated.
_FREE_REQUESTS = 5


@pytest.fixture(scope="module")
def locked_s3(s3_factory, ds):
    """A second moto server that checks credentials (IAM): a bucket holding a real checkpoint, and
    the keys of a user with no policy at all."""
    import boto3

    server = s3_factory({"INITIAL_NO_AUTH_ACTION_COUNT": str(_FREE_REQUESTS)})
    try:
        admin = {"endpoint_url": server.endpoint, **server.credentials}
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        client = boto3.client("s3", **admin)
        client.create_bucket(Bucket="locked")
        local = ds.path("s2-bf16-ws2")
        client.put_object(Bucket="locked", Key="ckpt/latest", Body=(local / "latest").read_bytes())
        # From here on every request needs credentials moto knows: the tests' usual ones are refused.
        with pytest.raises(ClientError) as refused:
            client.list_objects_v2(Bucket="locked")
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
        yield server, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        server.stop()


@pytest.mark.parametrize("who", ["a user without a policy", "an unknown key"])
def test_s3_access_denied_has_a_code_and_writes_nothing(who, locked_s3, monkeypatch, tmp_path):
    server, key_id, secret = locked_s3
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    if who == "a user without a policy":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code, report = run_json("validate", "s3://locked/ckpt")
    assert code == 2 and report["error"]["code"] == "CK911", report
    assert "AWS_*" in report["error"]["hint"]
    result = run("reconstruct", "s3://locked/ckpt", tmp_path / "out")
    assert result.exit_code == 2 and "CK911" in result.output, result.output
    assert not (tmp_path / "out").exists()
