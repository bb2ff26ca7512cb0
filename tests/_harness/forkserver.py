"""A process that has imported ckptspec and its heavy dependencies once, and forks a child per command.

The crash tests run a ckptspec writer hundreds of times (killed at a step, run again, counted);
as ``python -m ckptspec`` each run paid the interpreter start and the imports again (torch alone
1.3 s), which was most of their time. A forked child is still a separate process: it gets its
own environment (``CKPTSPEC_FAILPOINT`` included, which ckptspec reads at its first write step),
its own working directory and output files, and is really killed by the signal a failpoint
sends. It runs ``ckptspec.cli.main``, as ``python -m ckptspec`` does.

Protocol: one JSON line per request on stdin (args, env, cwd, stdout and stderr file paths),
one JSON line with the child's exit status on stdout (negative: killed by that signal).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import traceback

# What the commands import, imported once here (every import a child makes afterwards is its own).
import numpy  # noqa: F401
import safetensors.numpy  # noqa: F401
import torch  # noqa: F401

import ckptspec.cli
import ckptspec.deepspeed.validate
import ckptspec.export.api


def _child(request: dict) -> None:
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        # As a terminal gives it, whatever the server inherited (a suite started in the background
        # ignores SIGINT): Python's own handler, so Ctrl-C is a KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["ckptspec", *request["args"]]
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


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
