"""A process that has imported ckptspec and its heavy dependencies once, and forks a child per command.

The crash tests run a ckptspec writer hundreds of times (killed at a step, run again, counted);
as ``python -m ckptspec`` each run paid the interpreter start and the imports again (torch alone
1.3 s), which was most of their time. A forked child is still a separate process: it gets its
own environment (``CKPTSPEC_FAILPOINT`` included, which ckptspec reads at its first write step),
its own working directory and output files, and is really killed by the signal a failpoint
sends. It runs ``ckptspec.cli.main``, as ``python -m ckptspec`` does.

Two ways in:
* ``forkserver.py``: one JSON line per request on stdin (args, env, cwd, stdout and stderr file
  paths), one JSON line with the child's exit status on stdout (negative: killed by that signal);
* ``forkserver.py --socket PATH``: many clients at once on a Unix socket, each sending its
  request with its own stdin, stdout and stderr (``forkclient.py``, a drop-in ``ckptspec``
  executable for the docs' console transcripts).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import traceback

# What the commands import, imported once here (every import a child makes afterwards is its own).
import numpy  # noqa: F401
import safetensors.numpy  # noqa: F401
import torch  # noqa: F401

import ckptspec.cli
import ckptspec.deepspeed.check.zero
import ckptspec.export.api


def _child(request: dict, stdio: list[int]) -> None:
    """Run one command in this (forked) process and exit with its status; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, source in enumerate(stdio):
            os.dup2(source, fd)
        # As a terminal gives it, whatever the server inherited (a suite started in the background
        # ignores SIGINT): Python's own handler, so Ctrl-C is a KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["ckptspec", *request["args"]]  # the name the installed command runs under
        ckptspec.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what an uncaught exception does to `python -m ckptspec`
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(request: dict, stdio: list[int]) -> int:
    """Fork a child for ``request`` and wait for it: its exit code, or minus the signal that killed it."""
    pid = os.fork()
    if pid == 0:
        _child(request, stdio)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve_pipe() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        stdio = [
            os.open(os.devnull, os.O_RDONLY),
            os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
            os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
        ]
        code = _run(request, stdio)
        for fd in stdio:
            os.close(fd)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


def serve_socket(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-client handlers are reaped by the kernel
    while True:
        client, _ = server.accept()
        if os.fork() == 0:  # a handler per client, so clients run side by side
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            message, stdio, _, _ = socket.recv_fds(client, 1 << 20, 3)
            code = _run(json.loads(message), stdio)
            client.send(json.dumps({"returncode": code}).encode())
            os._exit(0)
        client.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--socket"]:
        serve_socket(sys.argv[2])
    else:
        serve_pipe()
