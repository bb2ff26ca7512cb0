"""``ckptspec ARGS`` in a process of its own, as a user runs it, without paying the start-up each time.

Each command runs in a child forked from ``forkserver.py``, one per test process, which has
imported ckptspec (and torch and numpy where installed) once: its own process, environment,
working directory and exit status (a signal that kills it is a negative return code, as with
``subprocess``). ``python -m ckptspec`` cost 0.3-1.5 s a run in start-up and imports, most of the
crash and fault tests' time. The server speaks one protocol, a Unix socket (see forkserver.py);
``forkclient.py`` is the same request as a ``ckptspec`` executable.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_START_TIMEOUT_S = 120


class ForkServer:
    """One ``forkserver.py`` per test process, started at the first command (see its docstring),
    under ``prefix`` (a command that runs it, such as ``setpriv ...``)."""

    def __init__(self, prefix: tuple[str, ...] = ()) -> None:
        self.process: subprocess.Popen | None = None
        self.prefix = prefix
        self.folder = Path(tempfile.mkdtemp(prefix="ckptspec-forkserver-"))

    def address(self) -> Path:
        """The server's socket, the server started first if it is not running."""
        path = self.folder / "server.sock"
        if self.process is None or self.process.poll() is not None:
            path.unlink(missing_ok=True)
            script = Path(__file__).with_name("forkserver.py")
            # Its stdin is a pipe it reads EOF from when this process ends, however it ends: it stops then.
            command = [*self.prefix, sys.executable, str(script), "--socket", str(path)]
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE)
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not path.exists():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not start (exit {self.process.poll()})")
                time.sleep(0.02)
        return path

    def run(self, args: list[str], env: dict, cwd: Path | None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as stdin:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
                connection.connect(str(self.address()))
                request = {"args": args, "env": env, "cwd": str(cwd or Path.cwd())}
                socket.send_fds(
                    connection, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()]
                )
                reply = connection.recv(4096)
            if not reply:
                raise RuntimeError(f"the fork server died (exit {self.process.poll()})")
            out.seek(0)
            err.seek(0)
            text = (out.read().decode(errors="replace"), err.read().decode(errors="replace"))
            return subprocess.CompletedProcess(args, json.loads(reply)["returncode"], *text)


SERVER = ForkServer()
# Root reads and lists whatever the modes say (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): commands run
# with ``unprivileged`` come from a fork server without them, so that a test's ``chmod 000`` is a
# real EACCES. A user who is not root has neither to drop.
_DROP_READ_CAPS = ("--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search")
_UNPRIVILEGED = ForkServer(("setpriv", *_DROP_READ_CAPS) if os.geteuid() == 0 else ())


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
    return (_UNPRIVILEGED if unprivileged else SERVER).run([str(a) for a in args], child, cwd)
