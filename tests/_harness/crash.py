"""Crash injection: run a ckptspec writer and stop it at a chosen step of its writes.

``ckptspec._fs.io_point`` marks every step of every write (create, write, fsync, rename,
remove) and, under ``CKPTSPEC_FAILPOINT``, kills the process there (``kill:N``: SIGKILL),
stops it like a scheduler or a user (``term:N``, ``int:N``) or fails the write (``enospc:N``).
``steps`` counts a command's steps; ``points`` samples them (every one with
``CKPTSPEC_CRASH_ALL=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _ForkServer:
    """One ``forkserver.py`` per test process, started at the first command (see its docstring)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def run(self, args: list[str], env: dict, cwd: Path | None) -> subprocess.CompletedProcess:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {"args": args, "env": env, "cwd": str(cwd or Path.cwd()), "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
            if not reply:
                raise RuntimeError(f"the fork server died (exit {self.process.wait()})")
            code = json.loads(reply)["returncode"]
            return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())


_SERVER = _ForkServer()


def run(args: list[str], failpoint: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``ckptspec ARGS`` in a child process of its own, with a failpoint if given."""
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTSPEC_FAILPOINT", "CKPTSPEC_DEBUG")}
    if failpoint:
        env["CKPTSPEC_FAILPOINT"] = failpoint
    return _SERVER.run(list(map(str, args)), env, cwd)


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
