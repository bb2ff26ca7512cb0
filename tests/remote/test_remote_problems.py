"""A server that misbehaves, for real: nginx dropping the connection in the middle of a file,
a file that changes between validation and the read of its tensors, no range support, a
denied directory, an answer that stalls. Each is an error with its code, and nothing is written."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from ckptspec import location
from ckptspec.cli import cli


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def nothing_in(directory) -> bool:
    return not directory.exists() or not any(directory.iterdir())


@pytest.fixture
def served(nginx, ds):
    """A fresh copy of a real ZeRO-2 checkpoint on nginx: (local copy, its path in URLs)."""
    return nginx.serve(ds.path("s2-bf16-ws2"))


@pytest.fixture
def small_metadata_reads(monkeypatch):
    """Metadata read in pieces under nginx's 3 KiB of free bytes (headers included) on /stall/ and /drop/, so that
    validation passes there and the connection breaks while tensor bytes are streamed."""
    monkeypatch.setattr(location.settings, "TAIL", 2048)
    monkeypatch.setattr(location.settings, "READ_AHEAD", 0)
    monkeypatch.setenv("CKPTSPEC_REMOTE_RETRIES", "1")
    monkeypatch.setenv("CKPTSPEC_REMOTE_BACKOFF", "0.05")


def test_connection_dropped_mid_file_writes_nothing(served, nginx, small_metadata_reads, tmp_path):
    _, path = served
    url = nginx.url(path, "drop/")
    checked = run("validate", url, "--no-hash")
    assert checked.exit_code == 0, checked.output  # metadata reads fit before the drop
    mark = nginx.mark()
    result = run("reconstruct", url, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "CK915" in result.output and "connection" in result.output, result.output
    assert nothing_in(tmp_path / "out")
    # nginx itself says it cut an answer short: a body smaller than the range asked for.
    cut = []
    for _, uri, status, sent, asked in nginx.since(mark):
        if uri.startswith(f"/drop/{path}/") and status == 206:
            start, end = asked.removeprefix("bytes=").split("-")
            cut += [uri] if sent < int(end) + 1 - int(start) else []
    assert cut, nginx.since(mark)


@pytest.mark.parametrize("change", ["grown", "same-size"])
def test_file_changed_after_validation_writes_nothing(
    change, served, nginx, small_metadata_reads, monkeypatch, tmp_path
):
    """The file is rewritten between validation (which saw its size and ETag) and the streaming
    of its tensors: every range request is pinned with If-Match, nginx answers 412, CK913. (A small
    tail: else these small files are fetched whole by validation, kept, and not fetched again.)"""
    local, path = served
    tag = (local / "latest").read_text().strip()
    victim = local / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    from ckptspec.export import writers

    original = writers.write_consolidated

    def rewrite_then_write(*args, **kwargs):
        data = victim.read_bytes()
        victim.write_bytes(data + b"\0" * 4096 if change == "grown" else data[::-1])
        stat = victim.stat()
        os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))  # a new ETag either way
        return original(*args, **kwargs)

    monkeypatch.setattr(writers, "write_consolidated", rewrite_then_write)
    result = run("reconstruct", nginx.url(path), tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "CK913" in result.output and victim.name in result.output, result.output
    assert nothing_in(tmp_path / "out")


def test_no_range_support_denied_and_timeout(served, nginx, small_metadata_reads, monkeypatch, tmp_path):
    """(A file smaller than the tail ckptspec reads at once is fetched whole, from byte 0, which
    needs no range support; the small tail makes these files behave like large ones.)"""
    _, path = served
    result = run("validate", nginx.url(path, "norange/"), "--no-hash", "--format", "json")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["code"] == "CK912", result.output

    result = run("validate", nginx.url(path, "denied/"), "--format", "json")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["code"] == "CK911", result.output

    # /stall/ trickles a byte now and then after its first 3 KiB: the timeout is a deadline for
    # the whole request (CKPTSPEC_REMOTE_TIMEOUT), which the trickle cannot keep alive.
    monkeypatch.setenv("CKPTSPEC_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("CKPTSPEC_REMOTE_RETRIES", "0")
    result = run("reconstruct", nginx.url(path, "stall/"), tmp_path / "out")
    assert result.exit_code == 2 and "CK914" in result.output, result.output
    assert nothing_in(tmp_path / "out")


def test_unknown_protocol_and_missing_backend(monkeypatch):
    result = run("validate", "nosuchprotocol://bucket/ckpt", "--format", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 2 and report["error"]["code"] == "CK917", report
    assert "fsspec knows no protocol 'nosuchprotocol'" in report["error"]["hint"]

    import sys

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if the gcs extra were not installed
    result = run("validate", "gs://bucket/ckpt/manifest.json", "--format", "json")
    report = json.loads(result.stdout)
    assert result.exit_code == 2 and report["error"]["code"] == "CK917", report
    assert "pip install 'ckptspec[gcs]'" in report["error"]["hint"]
