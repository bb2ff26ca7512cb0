"""Crash injection: run a ckptspec writer and stop it at a chosen step of its writes.

``ckptspec._fs.io_point`` marks every step of every write (create, write, fsync, rename,
remove) and, under ``CKPTSPEC_FAILPOINT``, kills the process there (``kill:N``: SIGKILL),
stops it like a scheduler or a user (``term:N``, ``int:N``) or fails the write (``enospc:N``).
``steps`` counts a command's steps; ``points`` (states.py) samples them (every one with
``CKPTSPEC_CRASH_ALL=1``). Tests reach this module through the ``crash`` fixture (marked
``subprocess``); the pure functions of states.py they may import.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import cli_process

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], failpoint: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ckptspec ARGS`` in a child process of its own, with a failpoint if given."""
    return cli_process.run(args, failpoint=failpoint, cwd=cwd)


def steps(args: list[str], tmp: Path) -> int:
    """How many write steps the command takes (it runs to completion)."""
    tmp.mkdir(parents=True, exist_ok=True)
    counter = tmp / "steps.txt"
    done = run(args, f"count:{counter}")
    assert done.returncode == 0, done.stdout + done.stderr
    return int(counter.read_text())
