"""Work for a second CPU: a forked copy of this process computes one part and sends back bytes.

``fork()`` copies the process as it is, so the child needs no arguments: what it works on is
already there. It sends its result through a pipe and leaves without running any cleanup. When no
child can be made safely (not Linux, one CPU, other threads running) or it fails in any way, the
caller is told so and does that part itself: the outcome is the same either way, only slower.
Used by ``checkpoint.prescan`` (the opcode walk) and the CK2xx checks of a large checkpoint.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Callable


def can_fork() -> bool:
    # fork() copies only the calling thread: with other threads running (hashing pools, a
    # DeepSpeed job) a lock they hold would stay held in the child.
    return sys.platform == "linux" and threading.active_count() == 1 and len(os.sched_getaffinity(0)) > 1


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
        if self._pid is None:
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
        if self._pid is not None:
            self._pipe.close()
            os.kill(self._pid, signal.SIGKILL)
            os.waitpid(self._pid, 0)
            self._pid = None
