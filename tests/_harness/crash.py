"""Crash injection: run a ckptspec writer and stop it at a chosen step of its writes.

``ckptspec._fs.io_point`` marks every step of every write (create, write, fsync, rename,
remove) and, under ``CKPTSPEC_FAILPOINT``, kills the process there (``kill:N``: SIGKILL),
stops it like a scheduler or a user (``term:N``, ``int:N``) or fails the write (``enospc:N``).
``steps`` counts a command's steps; ``points`` samples them (every one with
``CKPTSPEC_CRASH_ALL=1``).
"""

from __future__ import annotations

import os
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


def points(total: int, sample: int = 8) -> list[int]:
    """Which steps to stop at: all with CKPTSPEC_CRASH_ALL=1, else ``sample`` spread over all of
    them, the first and the last included (the commit sits at the end)."""
    if os.environ.get("CKPTSPEC_CRASH_ALL") or total <= sample:
        return list(range(1, total + 1))
    spread = {1 + round(i * (total - 1) / (sample - 1)) for i in range(sample)}
    return sorted(spread | {total - 1, total})


def visible(directory: Path) -> dict[str, bytes]:
    """The files a reader sees in ``directory``: every file but hidden ones (temporaries, journals)."""
    if not directory.exists():
        return {}
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    }


def hidden(directory: Path) -> list[str]:
    """Hidden files and directories below ``directory``: what a run may leave behind."""
    if not directory.exists():
        return []
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob(".*"))
