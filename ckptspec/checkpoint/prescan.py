"""Scan and unpickle at once: a forked process walks the opcodes ahead of this one's unpickler.

The C unpickler may run an opcode only once ``scan_pickle``'s walk has passed it. With a tag
directory's pickles known up front, a forked child walks them one after the other and reports
how far it has got every ``PASSED_EVERY`` bytes; this process unpickles each one behind it,
through a reader that hands the unpickler only bytes the walk has passed (``Streamed``). The walk
judges an opcode from what comes before it alone, so the unpickler never runs an opcode the walk
has not let through, and the two take about as long as the slower of them, not the sum. A pickle
the walk refuses is reported as a walk run beforehand would report it: the walk's verdict is
asked for whatever the unpickler did (``Streamed.refusal``). The child decodes nothing and sends
back only positions and the walk's messages, as text. Where a child cannot help or cannot be made
safely (small files, one CPU, threads running, not Linux), or fails in any way, this process walks
the pickles itself, each before it is unpickled: the verdicts are the same either way.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator

from .._forked import can_fork
from .pickle_scan import scan_pickle, walk

MIN_CHILD_BYTES = 2 * 1024 * 1024  # below this a walk ends before a process would start


def _verdict(data: bytes) -> ValueError | None:
    try:
        scan_pickle(data)
    except ValueError as e:
        return e
    return None


class Refused(Exception):
    """Raised to the unpickler when it asks for bytes the walk refused (never reaches a caller)."""


class _Feed:
    """The child's reports, read as they are needed: how far the walk has passed each pickle, and
    its verdicts. If the child dies or says anything unexpected, this process walks what is left."""

    def __init__(self, pickles: list[bytes], pipe) -> None:
        self.pickles, self._pipe = pickles, pipe
        self.passed = [0] * len(pickles)
        self.verdicts: dict[int, ValueError | None] = {}
        self._lost = False

    def wait(self, index: int, need: int) -> int:
        """How far the walk has passed pickle ``index``, once that is at least ``need`` bytes or
        the verdict is in (then the whole pickle if it passed, else raises Refused)."""
        while self.passed[index] < need and index not in self.verdicts:
            self._next_report(index)
        if self.passed[index] < need and self.verdicts[index] is not None:
            raise Refused
        return self.passed[index]

    def verdict(self, index: int) -> ValueError | None:
        while index not in self.verdicts:
            self._next_report(index)
        return self.verdicts[index]

    def _next_report(self, index: int) -> None:
        if not self._lost:
            if self._read():
                return
            self._lost = True
        verdict = self.verdicts[index] = _verdict(self.pickles[index])  # the child is gone: walk here
        if verdict is None:
            self.passed[index] = len(self.pickles[index])

    def _read(self) -> bool:
        """Apply the next report, ``P index position`` or ``V index message``; False at the end of
        the pipe or on anything else."""
        line = self._pipe.readline()
        try:
            kind, index, rest = line.decode("ascii").split(" ", 2)
            index = int(index)
            if not 0 <= index < len(self.pickles) or index in self.verdicts:
                return False
            if kind == "P":
                self.passed[index] = max(self.passed[index], min(int(rest), len(self.pickles[index])))
                return True
            message = json.loads(rest)
            if kind != "V" or not (message is None or isinstance(message, str)):
                return False
        except ValueError:  # an empty or cut line (the child died), or a bad one
            return False
        self.verdicts[index] = None if message is None else ValueError(message)
        if message is None:
            self.passed[index] = len(self.pickles[index])
        return True


class Streamed:
    """A pickle the child is walking: ``reader()`` for the unpickler, then ``refusal()``."""

    def __init__(self, feed: _Feed, index: int) -> None:
        self._feed, self._index = feed, index

    def reader(self) -> PassedBytes:
        return PassedBytes(self._feed.pickles[self._index], lambda need: self._feed.wait(self._index, need))

    def refusal(self) -> ValueError | None:
        """What the walk raised for this pickle (None: it passed), once the walk has ended."""
        return self._feed.verdict(self._index)


class PassedBytes:
    """A binary file over ``data`` that gives only bytes the walk has passed, waiting for them
    (``wait``; None: every byte has passed): what the C unpickler reads from. ``peek`` lets it take
    128 KiB at a time (from a bare BytesIO it reads once per opcode, a call each), and no read
    allocates more than is there, whatever size is asked for (io.BufferedReader's does: a FRAME
    claiming 2**40 bytes)."""

    def __init__(self, data: bytes, wait: Callable[[int], int] | None = None) -> None:
        self._data, self._wait, self._pos = data, wait, 0
        self._passed = len(data) if wait is None else 0

    def _upto(self, end: int) -> int:
        end = min(end, len(self._data))
        if end > self._passed and self._wait is not None:  # without a wait, every byte has passed
            self._passed = self._wait(end)
        return min(end, self._passed)

    def peek(self, size: int = 1) -> bytes:
        end = self._upto(self._pos + 1)  # at least one byte, if there is one
        return self._data[self._pos : max(end, min(self._pos + size, self._passed))]

    def read(self, size: int = -1) -> bytes:
        end = self._upto(len(self._data) if size is None or size < 0 else self._pos + size)
        chunk, self._pos = self._data[self._pos : end], end
        return chunk

    def readinto(self, buffer) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def readline(self) -> bytes:
        newline = self._data.find(b"\n", self._pos)
        return self.read((len(self._data) if newline < 0 else newline + 1) - self._pos)


def _walk_all(pickles: list[bytes], out) -> None:
    """The child's work: walk each pickle, reporting progress and verdicts as it goes."""
    for index, data in enumerate(pickles):

        def passed(pos, index=index):
            out.write(b"P %d %d\n" % (index, pos))
            out.flush()

        try:
            walk(data, fast=True, passed=passed)
            message = None
        except ValueError as e:
            message = str(e)
        out.write(b"V %d %s\n" % (index, json.dumps(message).encode()))
        out.flush()


def scan_all(
    pickles: list[bytes], meanwhile: Callable[[], object] | None = None
) -> Iterator[tuple[int, ValueError | None | Streamed]]:
    """``(index, verdict)`` for every pickle, in order: what scan_pickle raised (None: it passed),
    or a ``Streamed`` pickle the child is walking, to be unpickled through its reader.

    ``meanwhile``: work of the caller's that needs no verdict (importing what comes next), run
    here while the child starts walking (only when there is a child: otherwise the caller does
    that work in its own time)."""
    child = _fork_walker(pickles) if sum(map(len, pickles)) >= MIN_CHILD_BYTES and can_fork() else None
    if child is None:
        yield from ((i, _verdict(data)) for i, data in enumerate(pickles))
        return
    pid, pipe = child
    try:
        if meanwhile is not None:
            meanwhile()
        feed = _Feed(pickles, pipe)
        for i in range(len(pickles)):
            yield i, Streamed(feed, i)
    finally:
        pipe.close()
        # Done or given up: the child has nothing left to tell (it may still be writing).
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _fork_walker(pickles: list[bytes]):
    """(pid, the pipe its reports come through) of a child walking ``pickles`` (``_walk_all``), or
    None when no process or pipe is to be had (a limit, memory, descriptors): then walk here."""
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:  # the child: walk, report, leave without running any cleanup
        status = 1
        try:
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                _walk_all(pickles, out)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, os.fdopen(read_end, "rb")
