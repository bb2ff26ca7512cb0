"""Fixtures of the remote tests: real nginx and moto S3 servers on 127.0.0.1, and checkpoints put on them.

The servers start once per test session (per xdist worker) on free ports and stop at its end;
``scripts/env.sh`` installs both (a missing one is an error, never a skip).
"""

from __future__ import annotations

import pytest
from _harness.servers import Nginx, S3Server, start_nginx, start_s3


@pytest.fixture(scope="session")
def nginx(tmp_path_factory) -> Nginx:
    server = start_nginx(tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> S3Server:
    server = start_s3(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch) -> dict[str, str]:
    """The environment a user sets to reach the S3 server (credentials and endpoint), for this test."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3.env
