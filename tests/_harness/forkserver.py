"""A process that has imported ckptspec and its heavy dependencies once, and forks a child per command.

The crash tests run a ckptspec writer hundreds of times (killed at a step, run again, counted);
as ``python -m ckptspec`` each run paid the interpreter start and the imports again (torch alone
1.3 s), which was most of their time. A forked child is still a separate process: it gets its
own environment (``CKPTSPEC_FAILPOINT`` included, which ckptspec reads at its first write step),
its own working directory and output files, and is really killed by the signal a failpoint
sends. It runs ``ckptspec.cli.main``, as ``python -m ckptspec`` does; or, for the docs' ``python run``
blocks, a program as ``python -c CODE`` runs it (``__main__``, the working directory first on the path).

One way in, a Unix socket (``forkserver.py --socket PATH``): each client sends one request (args,
env, cwd) with its own stdin, stdout and stderr as file descriptors (``SCM_RIGHTS``), and reads
one JSON reply with the child's exit status (negative: killed by that signal); a request with
``python`` (the code) instead runs that code as ``python -c`` would. Many clients run
side by side. The clients: ``cli_process.py`` (the tests) and ``forkclient.py`` (a drop-in
``ckptspec`` executable for the docs' console transcripts; ``--python-c`` for their ``python run`` blocks).
"""

from __future__ import annotations

import atexit
import builtins
import gc
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
import types
import warnings
from importlib import import_module
from importlib.util import find_spec

import ckptspec.cli
import ckptspec.deepspeed.check.zero
import ckptspec.export.api

# What the commands import, imported once here (every import a child makes afterwards is its own).
# Only what is installed: the unit tier's environment has no torch, and its commands never need it. The URL
# backends too: the crash tests of uploads run a command per kill point, each importing s3fs and botocore
# otherwise. None of them starts a thread or an event loop on import (fsspec's loop starts at first use).
# Warnings these imports give are recorded: a fresh interpreter running a `python run` block would print them, so
# that block's child prints them too (_python).
with warnings.catch_warnings(record=True) as _IMPORT_WARNINGS:
    for _name in ("numpy", "safetensors.numpy", "torch", "s3fs", "fsspec.implementations.http"):
        if find_spec(_name.partition(".")[0]):
            import_module(_name)
# Every child inherits these modules' objects: frozen, a child's full collection no longer scans them
# (measured 0.33 s -> 0.000 s per collection with torch imported), and their pages stay shared.
gc.freeze()


def _child(request: dict, stdio: list[int]) -> None:
    """Run one command in this (forked) process and exit with its status; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from this environment's TMPDIR, as a new process finds it
        for fd, source in enumerate(stdio):
            os.dup2(source, fd)
        # As a terminal gives it, whatever the server inherited (a suite started in the background
        # ignores SIGINT): Python's own handler, so Ctrl-C is a KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if "python" in request:
            _python(request["python"], request["args"])
        else:
            sys.argv = ["ckptspec", *request["args"]]  # the name the installed command runs under
            ckptspec.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
    except BaseException:  # what an uncaught exception does to `python -m ckptspec`
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _python(code: str, args: list[str]) -> None:
    """``python -c CODE ARGS`` in this child: the code runs as a new ``__main__`` with ``sys.argv`` and the path's
    first entry (the working directory) as ``-c`` gives them; then, as at the interpreter's exit, it waits for the
    threads the code started. The modules imported here before the fork are not imported again (their
    ``__main__``-independent state is what a fresh import gives: nothing ran in them since)."""
    for message in _IMPORT_WARNINGS:
        warnings.showwarning(message.message, message.category, message.filename, message.lineno)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c", *args]
    sys.path[0] = ""
    exec(compile(code, "<string>", "exec"), main.__dict__)
    threading._shutdown()


def _start(request: dict, stdio: list[int], keep: list) -> int:
    """Fork the child that runs ``request``; returns its pid. ``keep``: what only the server holds (its
    sockets and wake-up pipe), closed in the child."""
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for held in keep:
            held.close() if isinstance(held, socket.socket) else os.close(held)
        _child(request, stdio)
    for fd in stdio:  # the child's now: a pipe's write end kept here would keep its reader waiting for EOF
        os.close(fd)
    return pid


def _answer(waiting: dict[int, socket.socket]) -> None:
    """Reply to the client of every child that has ended: its exit code, or minus the signal that killed it."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        client = waiting.pop(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with client:
            client.send(json.dumps({"returncode": code}).encode())


def serve_socket(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Bound and listening under another name first: clients wait for ``path`` to exist, and a socket
    # bound but not yet listening refuses them (ECONNREFUSED, seen on a loaded machine).
    server.bind(path + ".starting")
    server.listen(64)
    os.rename(path + ".starting", path)
    # One fork per command: this loop forks each command's child itself and answers its client when
    # the child ends (SIGCHLD wakes the select up), so clients still run side by side. A forked
    # handler per client in between cost a second fork and exit of this large process: measured,
    # 22 ms of CPU per command instead of 11 (`ckptspec --version`, torch imported).
    wake, wake_in = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(wake_in, False)
    signal.set_wakeup_fd(wake_in)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # child pid -> its client
    while True:
        # stdin is a pipe from the test process that started this server: its end (EOF) ends the server.
        ready, _, _ = select.select([server, sys.stdin, wake], [], [])
        if sys.stdin in ready:
            return
        if wake in ready:
            os.read(wake, 1 << 16)  # bytes left over only wake the loop again
            _answer(waiting)
        if server in ready:
            client, _ = server.accept()  # a client sends its request at once (cli_process, forkclient)
            message, stdio, _, _ = socket.recv_fds(client, 1 << 20, 3)
            pid = _start(json.loads(message), stdio, [server, client, wake, wake_in, *waiting.values()])
            waiting[pid] = client


if __name__ == "__main__":
    if sys.argv[1:2] != ["--socket"] or len(sys.argv) != 3:
        raise SystemExit("usage: forkserver.py --socket PATH")
    serve_socket(sys.argv[2])
