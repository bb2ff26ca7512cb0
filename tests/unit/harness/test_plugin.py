"""The harness plugin (tests/_harness/plugin.py) marks a test by the fixtures it uses, and loads
without torch or DeepSpeed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _harness import plugin


def test_a_fork_server_test_is_marked_subprocess(cli_server, request):
    assert request.node.get_closest_marker("subprocess") is not None
    assert request.node.get_closest_marker("deepspeed") is None
    assert cli_server.is_socket()


def test_a_committed_checkpoint_needs_no_deepspeed_mark(committed, request):
    assert (committed("s2-bf16-ws2") / "latest").is_file()
    assert request.node.get_closest_marker("deepspeed") is None


class _Item:
    def __init__(self, *fixturenames: str) -> None:
        self.fixturenames = fixturenames
        self.marks: list[str] = []

    def add_marker(self, name: str) -> None:
        self.marks.append(name)


@pytest.mark.parametrize(
    "fixtures,marks",
    [
        (("ds",), ["deepspeed"]),
        (("ds_checkpoint", "tmp_path"), ["deepspeed"]),
        (("nginx", "ds_checkpoint", "ckptspec_process"), ["deepspeed", "remote", "subprocess"]),
        (("s3_env",), ["remote"]),
        (("committed", "ckptspec_cli", "tmp_path"), []),
    ],
)
def test_markers_follow_the_fixtures(fixtures, marks):
    item = _Item(*fixtures)
    plugin.pytest_collection_modifyitems([item])
    assert item.marks == marks


def test_the_plugin_imports_neither_torch_nor_deepspeed():
    code = "import sys; import _harness.plugin; print(sorted({'torch', 'deepspeed', 'numpy'} & set(sys.modules)))"
    tests = str(plugin.__file__).rsplit("/_harness/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tests)
    assert out.stdout.strip() == "[]"
