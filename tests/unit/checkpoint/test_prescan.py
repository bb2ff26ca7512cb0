"""Walk and unpickle at once (``prescan``): the unpickler never gets a byte the walk has not passed,
the verdicts and errors are those of one ``scan_pickle`` after another whichever process walked,
and no child process is left behind."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import signal
import struct
import zipfile

import pytest
from _harness.faults import tag_dir
from _harness.scenarios import COMMITTED

from ckptspec import _forked
from ckptspec.checkpoint import pickle_scan, prescan, states
from ckptspec.checkpoint.pickle_scan import scan_pickle
from ckptspec.checkpoint.states import StateCache

PARENT = os.getpid()

# Pickles that pass the scan and pickles it refuses, each for another reason.
PICKLES = [
    pickle.dumps({"w": list(range(3000)), "name": "x" * 5000}, protocol=2),
    b"\x80\x02Nr" + struct.pack("<I", 2**24) + b".",  # a memo index far past the pickle's end
    b"\x80\x02)" + b"\x85" * 200 + b".",  # tuples 201 deep
    pickle.dumps([("a", 1)] * 4000, protocol=2),
    b"\x80\x02(N",  # cut short
    pickle.dumps(tuple(range(50)), protocol=4),
]


def serial(pickles):
    verdicts = []
    for data in pickles:
        try:
            scan_pickle(data)
            verdicts.append(None)
        except ValueError as e:
            verdicts.append(str(e))
    return verdicts


def _text(verdict):
    if isinstance(verdict, prescan.Streamed):
        verdict = verdict.refusal()
    return None if verdict is None else str(verdict)


def side_by_side(pickles):
    found = [(i, _text(verdict)) for i, verdict in prescan.scan_all(pickles)]
    assert [i for i, _ in found] == list(range(len(pickles)))  # each once, in order
    return [text for _, text in found]


@pytest.fixture
def forks(monkeypatch):
    """Make a child for any size (the real threshold is 2 MiB), on any machine, and count the forks."""
    made = []
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            made.append(pid)
        return pid

    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    monkeypatch.setattr(prescan, "can_fork", lambda: True)
    monkeypatch.setattr(prescan.os, "fork", fork)
    return made


def reaped(pids) -> bool:
    """Every child forked here is gone and waited for (other tests' children may still run)."""
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return True


def test_verdicts_are_those_of_one_scan_after_another(forks, monkeypatch):
    real = prescan._verdict

    def verdict(data):
        assert os.getpid() != PARENT, "this process walked although the child did"
        return real(data)

    monkeypatch.setattr(prescan, "_verdict", verdict)
    assert side_by_side(PICKLES) == serial(PICKLES)
    assert len(forks) == 1
    assert sum(v is not None for v in serial(PICKLES)) == 3  # the refusals are really in the set
    assert reaped(forks)


# --------------------------------------------------------------------------- the gate itself


def _feed(data: bytes, reports: bytes) -> prescan.Streamed:
    """A pickle and what a child reported of it (one rule at a time: no child here)."""
    return prescan.Streamed(prescan._Feed([data], io.BytesIO(reports)), 0)


def test_the_reader_gives_only_what_the_walk_passed():
    data = bytes(range(200))
    reader = _feed(data, b'P 0 100\nV 0 "memo index 9 at byte 150 is beyond"\n').reader()
    assert reader.read(60) == data[:60]
    assert reader.peek(1000) == data[60:100]  # all there is, no more
    assert reader.read(40) == data[60:100]
    with pytest.raises(prescan.Refused):
        reader.read(1)  # byte 100 was never passed: the walk refused further on


def test_a_pickle_that_passed_is_given_whole():
    data = bytes(range(200))
    streamed = _feed(data, b"P 0 100\nV 0 null\n")
    reader = streamed.reader()
    assert reader.read(150) == data[:150] and reader.readline() == data[150:]
    assert reader.read(10) == b"" and streamed.refusal() is None


def test_a_refusal_crosses_as_the_walks_own_message():
    streamed = _feed(PICKLES[1], b'V 0 "tuples nest\\ndeeper"\n')
    assert str(streamed.refusal()) == "tuples nest\ndeeper"


@pytest.mark.parametrize(
    "reports",
    [b"", b"P 0 4\n", b"P 0 4\nV 0 nul", b"X 0 4\n", b"P 7 4\n", b"V 0 17\n", b"P 0 4", b"\xff\n"],
    ids=["silent", "died-midway", "cut-verdict", "unknown-kind", "unknown-pickle", "not-a-message", "cut", "bytes"],
)
def test_a_child_that_dies_or_talks_nonsense_leaves_the_walk_to_this_process(reports):
    reported = 4 if reports.startswith(b"P 0 4") else 0  # what the child said it passed before going
    for data, expected in zip(PICKLES, serial(PICKLES)):
        streamed = _feed(data, reports)
        try:
            handed = streamed.reader().read()  # waits for this process's own walk
        except prescan.Refused:
            handed = b""
        assert _text(streamed.refusal()) == expected
        assert handed == data if expected is None else len(handed) <= reported


# --------------------------------------------------------------------------- with a real child


@pytest.mark.parametrize(
    "tail, message",
    [
        (b"Nr" + struct.pack("<I", 2**31) + b".", "memo index 2147483648"),  # a LONG_BINPUT past the end
        (b"NB" + struct.pack("<I", 2**31 - 1) + b"xy.", "truncated"),  # BINBYTES claiming 2 GiB
    ],
    ids=["memo-index", "claimed-size"],
)
def test_the_unpickler_stops_before_a_refused_opcode(forks, tmp_path, monkeypatch, tail, message):
    """Megabytes of a sound pickle, then an opcode the walk refuses (the C unpickler would
    allocate gigabytes for either): the unpickler is never handed it, and the error is the
    walk's, as when the walk ran first."""
    body = pickle.dumps([list(range(200)) for _ in range(3000)], protocol=2)
    refused_at = len(body)  # the opcode after a NONE where STOP was
    data = body[:-1] + tail
    handed = []

    def spy(method):
        real = getattr(prescan.PassedBytes, method)

        def handing(self, *args):
            start, chunk = self._pos, real(self, *args)
            handed.append((start, start + len(chunk)))
            return chunk

        monkeypatch.setattr(prescan.PassedBytes, method, handing)

    for method in ("read", "peek", "readline"):
        spy(method)
    path = tmp_path / "late.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("late/data.pkl", data)
    together = StateCache()
    together.load_all([path])
    assert len(forks) == 1 and len(data) > 2 * pickle_scan.PASSED_EVERY
    assert len(handed) > 4  # it unpickled behind the walk, in pieces, not after it
    assert max(end for _, end in handed) <= refused_at
    assert str(together.load(path).error) == str(StateCache().load(path).error)
    assert message in str(together.load(path).error)
    assert reaped(forks)


def test_a_child_killed_midway_leaves_the_walk_to_this_process(forks, monkeypatch):
    real = prescan._walk_all

    def walk_then_die(pickles, out):
        real(pickles[:1], out)  # one verdict, then gone
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(prescan, "_walk_all", walk_then_die)
    assert side_by_side(PICKLES) == serial(PICKLES)
    assert len(forks) == 1
    assert reaped(forks)


def test_a_walk_given_up_midway_ends_its_child(forks):
    scans = prescan.scan_all(PICKLES)
    next(scans)
    scans.close()
    assert len(forks) == 1
    assert reaped(forks)


def test_a_fork_that_fails_leaves_the_walk_to_this_process(monkeypatch):
    def fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    monkeypatch.setattr(prescan, "can_fork", lambda: True)
    monkeypatch.setattr(prescan.os, "fork", fork)
    assert side_by_side(PICKLES) == serial(PICKLES)


def test_without_a_second_core_or_enough_bytes_nothing_is_forked(monkeypatch):
    monkeypatch.setattr(prescan.os, "fork", lambda: pytest.fail("forked"))
    assert sum(map(len, PICKLES)) < prescan.MIN_CHILD_BYTES
    assert side_by_side(PICKLES) == serial(PICKLES)
    monkeypatch.setattr(prescan.os, "sched_getaffinity", lambda _: {0})
    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    assert side_by_side(PICKLES) == serial(PICKLES)


def assert_as_load_gives(together: StateCache, paths: list) -> None:
    """Each file's state and error in ``together`` are those ``load`` alone gives."""
    for path in paths:
        one, alone = together.load(path), StateCache().load(path)
        assert (repr(one.state), type(one.error), str(one.error)) == (
            repr(alone.state),
            type(alone.error),
            str(alone.error),
        )


def test_load_all_gives_what_load_gives_on_a_real_checkpoint(forks, tmp_path):
    """A real DeepSpeed save (committed), a malicious file, a cut copy and a file both malicious
    and refused by the walk further on, beside it: the states and the errors of ``load_all`` are
    those of ``load``, file by file."""
    save = tmp_path / "ckpt"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], save)
    files = sorted(tag_dir(save).glob("*.pt"))
    assert len(files) == 3
    evil = tag_dir(save) / "evil.pt"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(print, protocol=2))  # a global not on the allowlist
    cut = tag_dir(save) / "cut.pt"
    cut.write_bytes(files[0].read_bytes()[:-100])
    # The unpickler meets the forbidden global first; the walk's refusal comes later in the bytes
    # and is what a walk run beforehand reports.
    both = tag_dir(save) / "both.pt"
    with zipfile.ZipFile(both, "w") as zf:
        zf.writestr("both/data.pkl", pickle.dumps(print, protocol=2)[:-1] + b"Nr" + struct.pack("<I", 2**24) + b".")
    every = [*files, evil, cut, both]

    together = StateCache()
    together.load_all(every)
    assert len(forks) == 1
    assert_as_load_gives(together, every)
    assert [together.load(p).error is None for p in every] == [True, True, True, False, False, False]
    assert "memo index" in str(together.load(both).error)
    assert reaped(forks)


def _torch_files(folder, pickles: list[tuple[str, bytes]]) -> list:
    """A file ``NAME.pt`` holding only ``NAME/data.pkl`` for each (name, pickle)."""
    paths = []
    for name, data in pickles:
        path = folder / f"{name}.pt"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{name}/data.pkl", data)
        paths.append(path)
    return paths


def test_a_refusal_found_by_the_child_reads_as_one_found_here(forks, tmp_path):
    """The child's verdict crosses as text; the error the reader reports from it is the same."""
    paths = _torch_files(tmp_path, [(f"f{i}", data) for i, data in enumerate(PICKLES[:4])])
    together = StateCache()
    together.load_all(paths)
    assert len(forks) == 1
    messages = [str(together.load(p).error) for p in paths]
    assert messages == [str(StateCache().load(p).error) for p in paths]
    assert "memo index" in messages[1] and "nest deeper" in messages[2]


def test_the_callers_work_runs_once_while_the_child_walks(forks):
    """``meanwhile`` runs in this process once the child is made, before any pickle is handed out."""
    seen, ran = [], []
    for i, _ in prescan.scan_all(PICKLES, lambda: ran.append((len(forks), list(seen)))):
        seen.append(i)
    assert ran == [(1, [])]
    assert reaped(forks)


def test_without_a_child_the_callers_work_is_left_to_the_caller(monkeypatch):
    monkeypatch.setattr(prescan.os, "sched_getaffinity", lambda _: {0})
    ran = []
    assert [i for i, _ in prescan.scan_all(PICKLES, lambda: ran.append(1))] == list(range(len(PICKLES)))
    assert ran == []


# ------------------------------------------------------------------ trees checked apart


def test_trees_checked_by_other_processes_read_as_trees_checked_here(forks, tmp_path, monkeypatch):
    """Every file but the last has its tree checked by another process (the real threshold is
    8 MiB) while the next ones are unpickled: a real DeepSpeed save, a cyclic tree (the walk lets
    it through, the tree check refuses it), a malicious file, a cut copy. The states and errors are
    those of ``load``, file by file, and each check took a process of its own."""
    monkeypatch.setattr(states, "CHECK_APART_BYTES", 0)
    monkeypatch.setattr(_forked, "can_fork", lambda: True)  # as the fixture does for the walker
    save = tmp_path / "ckpt"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], save)
    files = sorted(tag_dir(save).glob("*.pt"))
    cyclic = tag_dir(save) / "cyclic.pt"
    with zipfile.ZipFile(cyclic, "w") as zf:
        zf.writestr("cyclic/data.pkl", b"\x80\x02]q\x00h\x00a.")  # a list holding itself
    evil = tag_dir(save) / "evil.pt"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(print, protocol=2))
    cut = tag_dir(save) / "cut.pt"
    cut.write_bytes(files[0].read_bytes()[:-100])
    every = [files[0], cyclic, files[1], evil, cut, files[2]]
    checked_apart = []
    real = states._check_apart
    monkeypatch.setattr(states, "_check_apart", lambda raw, tree: checked_apart.append(raw.path) or real(raw, tree))

    together = StateCache()
    together.load_all(every)
    assert_as_load_gives(together, every)
    assert [together.load(p).error is None for p in every] == [True, False, True, False, False, True]
    assert "cycle" in str(together.load(cyclic).error)
    # Unpickled files but the last were checked apart, each by a process of its own.
    assert [p.name for p in checked_apart] == [files[0].name, "cyclic.pt", files[1].name]
    assert len(forks) == 1 + len(checked_apart)
    assert reaped(forks)


def test_a_tree_whose_checker_fails_is_checked_here(forks, tmp_path, monkeypatch):
    """A checker that dies sends nothing: the tree is checked in this process, refusal included."""
    monkeypatch.setattr(states, "CHECK_APART_BYTES", 0)
    monkeypatch.setattr(_forked, "can_fork", lambda: True)
    monkeypatch.setattr(states.torchfile, "check_decoded", _dies_in_a_child(states.torchfile.check_decoded))
    paths = _torch_files(tmp_path, [("cyclic", b"\x80\x02]q\x00h\x00a."), ("fine", PICKLES[0]), ("last", PICKLES[3])])
    together = StateCache()
    together.load_all(paths)
    assert [str(together.load(p).error) for p in paths] == [str(StateCache().load(p).error) for p in paths]
    assert "cycle" in str(together.load(paths[0]).error) and together.load(paths[1]).error is None
    assert len(forks) == 3  # the walker, and a checker for each file but the last
    assert reaped(forks)


def _dies_in_a_child(check):
    def checked(raw, tree):
        if os.getpid() != PARENT:
            os.kill(os.getpid(), signal.SIGKILL)
        return check(raw, tree)

    return checked
