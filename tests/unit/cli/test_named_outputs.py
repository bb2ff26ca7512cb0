"""What a command writing one named file does with what is already at that name (issue #37, item 4).

Was: `generate -o`, `extract -o`, `convert` and `migrate` renamed a temporary file over whatever
was there, so a symlink, a FIFO or a device node became a plain file (as root, `-o /dev/full`
destroyed the device). Now a symlink is written through (its target replaced atomically, the link
kept), a FIFO or character device is written in place, and a directory or socket is refused
(CK906). Every case is checked against the same command writing a plain new file; the device
nodes are made with mknod in a temporary directory, never the real /dev entries.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from ckptspec import _fs

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
SAVE = ROOT / "tests" / "data" / "deepspeed-0.19.8" / "s2-bf16-ws2"  # a real DeepSpeed save


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, ckptspec_process) -> Path:
    """A copy of the committed DeepSpeed save with its manifest embedded, for `extract`."""
    copy = tmp_path_factory.mktemp("embedded") / "ckpt"
    shutil.copytree(SAVE, copy)
    done = ckptspec_process(["embed", copy])
    assert done.returncode == 0, done.stderr
    return copy


COMMANDS = {
    "generate": lambda out, ck: ["generate", SAVE, "-o", out],
    "extract": lambda out, ck: ["extract", ck, "-o", out],
    "convert": lambda out, ck: ["convert", EXAMPLE, out],
    "migrate": lambda out, ck: ["migrate", EXAMPLE, out, "--to", "1.0"],
}


def _expected(name: str, embedded: Path, tmp_path: Path, ckptspec_process) -> bytes:
    """What the command writes to a new plain file."""
    plain = tmp_path / "plain.json"
    done = ckptspec_process(COMMANDS[name](plain, embedded))
    assert done.returncode == 0, done.stderr
    return plain.read_bytes()


def _ours(directory: Path) -> list[str]:
    return [p.name for p in _fs.leftovers(directory)]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_symlink_is_written_through_and_stays_a_symlink(name, embedded, tmp_path, ckptspec_process):
    expected = _expected(name, embedded, tmp_path, ckptspec_process)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "target.json"
    target.write_bytes(b"{}")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    done = ckptspec_process(COMMANDS[name](link, embedded))
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == expected
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the target's mode is kept
    assert _ours(tmp_path) == [] and _ours(elsewhere) == []


@pytest.mark.parametrize("name", COMMANDS)
def test_a_dangling_symlink_gets_its_target_created(name, embedded, tmp_path, ckptspec_process):
    expected = _expected(name, embedded, tmp_path, ckptspec_process)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "new.json")
    done = ckptspec_process(COMMANDS[name](link, embedded))
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and (tmp_path / "new.json").read_bytes() == expected


@pytest.mark.parametrize("name", COMMANDS)
def test_a_fifo_is_written_to_and_stays_a_fifo(name, embedded, tmp_path, ckptspec_process):
    expected = _expected(name, embedded, tmp_path, ckptspec_process)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        done = ckptspec_process(COMMANDS[name](fifo, embedded))
        if not stat.S_ISFIFO(os.lstat(fifo).st_mode):
            reader.kill()  # the FIFO was replaced: nobody will ever open it for writing
        got, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced"
    assert got == expected
    assert _ours(tmp_path) == []


def _mknod(path: Path, minor: int) -> None:
    """A character device node of the memory driver (major 1): minor 3 behaves as /dev/null, 7 as /dev/full."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("making a device node needs root (the FIFO test covers writing in place)")


@pytest.mark.parametrize("name", COMMANDS)
def test_a_character_device_is_written_to_and_never_replaced(name, embedded, tmp_path, ckptspec_process):
    null, full = tmp_path / "null", tmp_path / "full"
    _mknod(null, 3)
    _mknod(full, 7)
    done = ckptspec_process(COMMANDS[name](null, embedded))
    assert done.returncode == 0, done.stderr
    failed = ckptspec_process(COMMANDS[name](full, embedded))
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.startswith(f"{full}: CK906 cannot write: No space left on device"), failed.stderr
    assert "Traceback" not in failed.stderr
    for node, minor in ((null, 3), (full, 7)):
        st = os.lstat(node)
        assert stat.S_ISCHR(st.st_mode) and os.minor(st.st_rdev) == minor, f"{node.name} was replaced"
    assert _ours(tmp_path) == []


@pytest.mark.parametrize("name", COMMANDS)
def test_a_directory_or_socket_is_refused(name, embedded, tmp_path, ckptspec_process):
    directory = tmp_path / "dir.json"
    directory.mkdir()
    refused = ckptspec_process(COMMANDS[name](directory, embedded))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(f"{directory}: CK906 cannot write: it is a directory"), refused.stderr
    assert directory.is_dir() and list(directory.iterdir()) == []
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        refused = ckptspec_process(COMMANDS[name](sock_path, embedded))
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"{sock_path}: CK906 cannot write: it is a socket"), refused.stderr
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    assert _ours(tmp_path) == []
