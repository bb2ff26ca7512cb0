"""The processes of a ``torchrun`` job sharing one ckptspec write (``reshard``, ``export-universal``; issue #40).

Every rank runs the same command, the same code path, in the same order. Three things differ:

* **files**: the n-th file the command writes (``claims``) is written by rank ``n % size`` only, so each rank reads
  only the source bytes its own files need. A file's bytes do not depend on who writes it: the output is byte
  identical to a one-process run.
* **hashing**: a list of digests or file hashes (``map_split``) is cut into ``size`` shares, each rank hashes its
  own, and all ranks get the whole list back: the validation before and after the write is split too.
* **the commit**: rank 0 alone holds OUTPUT, makes the temporary directory (given to the others), writes
  ``latest`` and the manifest (``first_only``) and puts the directory in place, once every rank finished.

Every exchange between ranks is one ``all_gather_object`` of a status: a rank that fails sends its error at its
next exchange (``failing_together``), and every other rank then raises ``RankFailed`` naming it, so no rank waits
for a peer that stopped. Outside torchrun (or ``--nproc_per_node 1``) the share is one process and nothing is
exchanged. The transport between ranks (torch.distributed's gloo group) is ``export/torchrun.py``'s: this module
needs no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .errors import CkptspecError, RankFailed

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Failure:
    """What a failed rank sends instead of its value."""

    rank: int
    line: str  # its error line, as its command printed it
    exit_code: int


@dataclass
class Share:
    """This process's part of the job: rank ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1
    gather: Callable[[Any], list[Any]] | None = None  # every rank's value, by rank (the transport; None: one process)
    _files: int = 0  # files met so far: the same count on every rank
    written: list[str] = field(default_factory=list)  # this rank's files, as written
    _told: bool = False  # this rank's failure was sent already

    @property
    def first(self) -> bool:
        return self.rank == 0

    def claims(self, path: Any) -> bool:
        """Whether this rank writes the next file (``path``): the n-th file goes to rank ``n % size``."""
        mine = self._files % self.size == self.rank
        self._files += 1
        if mine:
            self.written.append(str(path))
        return mine

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank; ``RankFailed`` if a rank sent a failure."""
        if self.size == 1 or self.gather is None:
            return [value]
        out = self.gather(value)
        failed = [v for v in out if isinstance(v, _Failure)]
        if failed:
            self._told = True  # every rank saw it: nobody waits for another exchange
            raise _rank_failed(failed[0])
        return out

    def report(self) -> list[tuple[int, int]]:
        """Every rank's (files written, checkpoint bytes read), by rank."""
        return self.exchange((len(self.written), bytes_read()))

    def synchronize(self) -> None:
        """Wait until every rank got here (each rank's files are written, say)."""
        self.exchange(None)

    def from_first(self, make: Callable[[], T]) -> T:
        """``make()`` on rank 0, its value on every rank."""
        return self.exchange(make() if self.first else None)[0]

    def first_only(self, do: Callable[[], Any]) -> None:
        """``do()`` on rank 0 alone, as one process, once every rank got here (a write of the commit, after every
        rank wrote its files); the others wait for it."""
        self.synchronize()
        if self.first:
            with alone():
                do()
        self.synchronize()

    def map_split(self, work: Callable[[Sequence[T]], list[R]], items: Sequence[T]) -> list[R]:
        """``work(items)``, each rank doing every ``size``-th item from its rank on; the results in order."""
        if self.size == 1:
            return work(items)
        shares = self.exchange(work(items[self.rank :: self.size]))  # a failure here: sent by failing_together
        out: list[Any] = [None] * len(items)
        for rank, share in enumerate(shares):
            out[rank :: self.size] = share
        return out

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """A failure of this rank that the others have not seen yet is sent to them, then raised here."""
        try:
            yield
        except RankFailed:
            raise
        except BaseException as exc:
            self.tell(exc)
            raise

    def tell(self, exc: BaseException) -> None:
        """Send this rank's failure to the others at their next exchange (once; it waits for them to get there)."""
        if self.size == 1 or self._told or isinstance(exc, RankFailed):
            return
        self._told = True
        line = exc.to_line() if isinstance(exc, CkptspecError) else f"{type(exc).__name__}: {exc}"
        code = exc.exit_code if isinstance(exc, CkptspecError) else 2
        with contextlib.suppress(Exception):  # a peer that is gone already cannot be told
            self.exchange(_Failure(self.rank, line, code))


def _rank_failed(failure: _Failure) -> RankFailed:
    error = RankFailed(
        "CK918",
        f"rank {failure.rank} failed: {failure.line}",
        f"rank {failure.rank}'s error says why; nothing was written",
    )
    error.exit_code = failure.exit_code
    return error


_read = [0]  # checkpoint bytes this process read: tensor ranges, hashed tensors and files (the commit's too)
_read_lock = threading.Lock()  # file hashes are counted from several threads


def count_read(nbytes: int) -> None:
    with _read_lock:
        _read[0] += nbytes


def bytes_read() -> int:
    """Checkpoint bytes this process read so far (tensor ranges, digests, file hashes; not the pickles' metadata)."""
    return _read[0]


# Hashes the ranks computed together of files rank 0 is about to read whole (the commit's manifest): rank 0 looks them
# up instead of reading every file again. Keyed on each file's identity, so a file rewritten since is read.
_known: dict[tuple, str] = {}


def file_identity(path: Any) -> tuple:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def remember(key: tuple, value: str) -> None:
    _known[key] = value


def remembered(key: tuple) -> str | None:
    return _known.get(key)


def looking_up() -> bool:
    """Whether hashes are looked up first: in rank 0's commit (run alone) after the ranks hashed together."""
    return bool(_known) and current().size == 1


_CURRENT: contextvars.ContextVar[Share | None] = contextvars.ContextVar("ckptspec_share", default=None)


def current() -> Share:
    """The share of the running command (one process, recording nothing, outside a torchrun split)."""
    return _CURRENT.get() or Share()


@contextlib.contextmanager
def sharing(share: Share) -> Iterator[Share]:
    token = _CURRENT.set(share)
    try:
        yield share
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Run as one process (rank 0's commit): no file skipped, nothing exchanged."""
    with sharing(Share()):
        yield


_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun gives each process


def torchrun_size() -> int:
    """The number of processes torchrun started (1 outside torchrun, without its rendezvous variables, or in a
    process that a torchrun worker started: ``started_by_torchrun``)."""
    if not all(os.environ.get(name) for name in _RENDEZVOUS) or not started_by_torchrun():
        return 1
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        return 1


def started_by_torchrun() -> bool:
    """Whether torchrun started this process itself. A training script's subprocess inherits ``RANK``,
    ``WORLD_SIZE`` and ``MASTER_*`` from its torchrun worker: joining the job's group from there would wait for
    ranks that never come (measured: a ``ckptspec reshard`` run by rank 0 of a 2-process job hung until killed).
    On Linux the parent tells: torchrun's agent has no ``RANK`` of its own, a worker has. ``CKPTSPEC_SPLIT=1|0``
    decides instead (e.g. ``torchrun --no-python sh -c "ckptspec ..."``, whose parent is the shell)."""
    chosen = os.environ.get("CKPTSPEC_SPLIT")
    if chosen in ("0", "1"):
        return chosen == "1"
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:  # not Linux, or not readable: trust the variables
        return True
    return not any(variable.startswith(b"RANK=") for variable in parent)


def reports_findings() -> bool:
    """Whether this process prints the findings of a checkpoint every rank found invalid: rank 0 alone does."""
    return torchrun_size() <= 1 or os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def shared_by(share: Share) -> Iterator[Share]:
    """Run the command as ``share`` (its transport set up by the caller: ``export.torchrun``), each rank's failure
    told to the others; what was remembered for the commit is forgotten after."""
    try:
        with sharing(share), share.failing_together():
            yield share
    finally:
        _known.clear()
