"""Work for a second CPU: a forked copy of this process computes one part and sends back bytes.

``fork()`` copies the process as it is, so the child needs no arguments: what it works on is
already there. It sends its result through a pipe and leaves without running any cleanup. When no
child can be made safely (not Linux, one CPU, other threads running) or it fails in any way, the
caller is told so and does that part itself: the outcome is the same either way, only slower.
Used by ``checkpoint.prescan`` (the opcode walk), ``checkpoint.states`` (the tree checks), the
CK2xx checks of a large checkpoint and its tensor digests.

Forking is opt-in: a library must not copy its caller's process behind its back (native threads
of CUDA, NCCL or OpenMP are invisible to the thread check below, and their locks would be copied
held). The library uses one process unless ``CKPTSPEC_WORKERS`` asks for more; the CLI, whose
process is its own, asks for two (``fork_by_default``) unless ``CKPTSPEC_WORKERS=1``; inside a
training rank's save hook nothing forks, whatever is set (``no_forks``; docs/performance.md).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

WORKERS_VARIABLE = "CKPTSPEC_WORKERS"  # processes one command may use: 1 (the library's default) or more
_default_workers = 1
_forks_forbidden: ContextVar[bool] = ContextVar("ckptspec_forks_forbidden", default=False)


def fork_by_default() -> None:
    """The CLI's choice: its process is its own, so it uses a second CPU unless ``CKPTSPEC_WORKERS=1``."""
    global _default_workers
    _default_workers = 2


@contextmanager
def no_forks() -> Iterator[None]:
    """Nothing forks inside: a training rank's save hook, whose process holds CUDA/NCCL threads."""
    token = _forks_forbidden.set(True)
    try:
        yield
    finally:
        _forks_forbidden.reset(token)


def workers() -> int:
    """The processes this command may use: ``CKPTSPEC_WORKERS`` if a positive integer, else the
    default (1 in the library, 2 in the CLI); 1 inside ``no_forks``, whatever is set."""
    if _forks_forbidden.get():
        return 1
    try:
        asked = int(os.environ.get(WORKERS_VARIABLE, ""))
    except ValueError:
        return _default_workers
    return asked if asked > 0 else _default_workers


def can_fork() -> bool:
    # fork() copies only the calling thread: with other threads running (hashing pools, a
    # DeepSpeed job) a lock they hold would stay held in the child.
    return (
        workers() > 1 and sys.platform == "linux" and threading.active_count() == 1 and len(os.sched_getaffinity(0)) > 1
    )


class Forked:
    """A child computing ``work()``; ``result()`` is its bytes, or None when it failed. Leaving the
    ``with`` block ends a child whose result was never asked for."""

    def __init__(self, work: Callable[[], bytes]):
        self._pid: int | None = None
        self._pipe = None
        if not can_fork():
            return
        try:
            read_end, write_end = os.pipe()
        except OSError:
            return
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            return
        if pid == 0:  # the child: work, send, leave
            status = 1
            try:
                gc.disable()  # a collection would touch every object, copying the parent's memory
                os.close(read_end)
                data = work()
                with os.fdopen(write_end, "wb") as out:
                    out.write(data)
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        self._pid, self._pipe = pid, os.fdopen(read_end, "rb")

    def result(self) -> bytes | None:
        if self._pid is None or self._pipe is None:
            return None
        try:
            data = self._pipe.read()
        except OSError:
            data = None
        self._pipe.close()
        _, status = os.waitpid(self._pid, 0)
        self._pid = None
        return data if os.waitstatus_to_exitcode(status) == 0 else None

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:
        if self._pid is not None and self._pipe is not None:
            self._pipe.close()
            os.kill(self._pid, signal.SIGKILL)
            os.waitpid(self._pid, 0)
            self._pid = None
