"""Scan several ``data.pkl`` at once: the larger share in a forked process beside this one.

``scan_pickle`` (the opcode walk that must pass before the C unpickler runs) is pure Python and,
on a checkpoint of 100k tensors, a third of what ``generate`` costs; the unpickler itself cannot
run before it. With the files of a tag directory known up front, a child process scans the
largest pickles while this one scans the others and decodes each as soon as it passed. The
child only reports what ``scan_pickle`` raised, as text; it decodes nothing, so nothing it
builds crosses back. Where a child cannot help or cannot be made safely (one file, small files,
one CPU, threads running, not Linux), or fails in any way, this process scans everything itself:
the verdicts are the same either way.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from .pickle_scan import scan_pickle

MIN_CHILD_BYTES = 2 * 1024 * 1024  # below this a scan takes ~0.1 s: not worth a process


def _verdict(data: bytes) -> ValueError | None:
    try:
        scan_pickle(data)
    except ValueError as e:
        return e
    return None


def _can_fork() -> bool:
    # fork() copies only the calling thread: with other threads running (hashing pools, a
    # DeepSpeed job) a lock they hold would stay held in the child.
    return sys.platform == "linux" and threading.active_count() == 1 and len(os.sched_getaffinity(0)) > 1


def _child_share(sizes: list[int]) -> set[int]:
    """The indices the child scans: the largest pickles, up to half of the bytes (greedy)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    child, child_bytes, parent_bytes = set(), 0, 0
    for i in order:
        if child_bytes <= parent_bytes:
            child.add(i)
            child_bytes += sizes[i]
        else:
            parent_bytes += sizes[i]
    return child if child_bytes >= MIN_CHILD_BYTES and parent_bytes else set()


def scan_all(
    pickles: list[bytes], meanwhile: Callable[[], object] | None = None
) -> Iterator[tuple[int, ValueError | None]]:
    """``(index, what scan_pickle raised or None)`` for every pickle, each as soon as it is known.

    ``meanwhile``: work of the caller's that needs no verdict (importing what comes next), run
    here once this process has scanned its own share, while the child may still be scanning
    (only when there is a child: otherwise the caller does that work in its own time)."""
    child = _child_share([len(p) for p in pickles]) if len(pickles) > 1 and _can_fork() else set()
    if not child:
        yield from ((i, _verdict(data)) for i, data in enumerate(pickles))
        return
    try:
        read_end, write_end = os.pipe()
    except OSError:  # out of descriptors: scan here
        yield from ((i, _verdict(data)) for i, data in enumerate(pickles))
        return
    try:
        pid = os.fork()
    except OSError:  # no process to be had (a limit, memory): scan here
        os.close(read_end)
        os.close(write_end)
        yield from ((i, _verdict(data)) for i, data in enumerate(pickles))
        return
    if pid == 0:  # the child: scan its share, write the verdicts, leave without running any cleanup
        status = 1
        try:
            os.close(read_end)
            verdicts = {i: _verdict(pickles[i]) for i in child}
            text = json.dumps({i: None if v is None else str(v) for i, v in verdicts.items()}).encode()
            with os.fdopen(write_end, "wb") as out:
                out.write(text)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    pipe, reaped = os.fdopen(read_end, "rb"), False
    try:
        for i, data in enumerate(pickles):
            if i not in child:
                yield i, _verdict(data)
        if meanwhile is not None:
            meanwhile()
        text = pipe.read()
        status = os.waitpid(pid, 0)[1]
        reaped = True
        found = _decoded(text) if status == 0 else {}
        for i in sorted(child):
            if str(i) in found:
                message = found[str(i)]
                yield i, None if message is None else ValueError(message)
            else:
                yield i, _verdict(pickles[i])  # the child failed: scan here
    finally:
        pipe.close()
        if not reaped:  # interrupted before the child's verdicts were read: it is of no use now
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _decoded(text: bytes) -> dict:
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}
