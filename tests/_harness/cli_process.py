"""``ckptspec ARGS`` in a process of its own, as a user runs it, without paying the start-up each time.

Each command runs in a child forked from ``forkserver.py``, one per test process, which has
imported ckptspec, torch and numpy once: its own process, environment, working directory and
exit status (a signal that kills it is a negative return code, as with ``subprocess``).
``python -m ckptspec`` cost 0.3-1.5 s a run in start-up and imports, most of the crash and
fault tests' time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


class _ForkServer:
    """One ``forkserver.py`` per test process, started at the first command (see its docstring),
    under ``prefix`` (a command that runs it, such as ``setpriv ...``)."""

    def __init__(self, prefix: tuple[str, ...] = ()) -> None:
        self.process: subprocess.Popen | None = None
        self.prefix = prefix

    def run(self, args: list[str], env: dict, cwd: Path | None) -> subprocess.CompletedProcess:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [*self.prefix, sys.executable, str(Path(__file__).with_name("forkserver.py"))],
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
# Root reads and lists whatever the modes say (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): commands run
# with ``unprivileged`` come from a fork server without them, so that a test's ``chmod 000`` is a
# real EACCES. A user who is not root has neither to drop.
_DROP_READ_CAPS = ("--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")
_UNPRIVILEGED = _ForkServer(("setpriv", *_DROP_READ_CAPS) if os.geteuid() == 0 else ())


def run(
    args: list,
    *,
    failpoint: str | None = None,
    cwd: Path | None = None,
    env: dict | None = None,
    unprivileged: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``ckptspec ARGS`` in this environment (or ``env``), without a developer's
    ``CKPTSPEC_FAILPOINT`` or ``CKPTSPEC_DEBUG`` unless given; ``unprivileged``: without root's
    right to read any file."""
    child = (
        dict(env)
        if env is not None
        else {k: v for k, v in os.environ.items() if k not in ("CKPTSPEC_FAILPOINT", "CKPTSPEC_DEBUG")}
    )
    if failpoint:
        child["CKPTSPEC_FAILPOINT"] = failpoint
    return (_UNPRIVILEGED if unprivileged else _SERVER).run([str(a) for a in args], child, cwd)
