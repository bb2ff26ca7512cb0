"""Opcode scans side by side (``prescan``): the same verdicts as one ``scan_pickle`` after another,
whichever process gave them, and no child process left behind."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import struct
import zipfile

import pytest
from _harness.faults import tag_dir
from _harness.scenarios import COMMITTED

from ckptspec.checkpoint import prescan
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


def side_by_side(pickles):
    found = {i: None if error is None else str(error) for i, error in prescan.scan_all(pickles)}
    assert sorted(found) == list(range(len(pickles)))  # each once
    return [found[i] for i in range(len(pickles))]


@pytest.fixture
def forks(monkeypatch):
    """Make a child for any share (the real threshold is 2 MiB), on any machine, and count the forks."""
    made = []
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            made.append(pid)
        return pid

    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    monkeypatch.setattr(prescan, "_can_fork", lambda: True)
    monkeypatch.setattr(prescan.os, "fork", fork)
    return made


def reaped(pids) -> bool:
    """Every child forked here is gone and waited for (other tests' children may still run)."""
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return True


def test_verdicts_are_those_of_one_scan_after_another(forks, monkeypatch):
    largest, real = max(PICKLES, key=len), prescan._verdict

    def verdict(data):
        assert not (os.getpid() == PARENT and data is largest), "this process scanned the child's share"
        return real(data)

    monkeypatch.setattr(prescan, "_verdict", verdict)
    assert side_by_side(PICKLES) == serial(PICKLES)
    assert len(forks) == 1
    assert sum(v is not None for v in serial(PICKLES)) == 3  # the refusals are really in the set
    assert reaped(forks)


def test_the_child_takes_the_largest_pickles_up_to_half_of_the_bytes():
    mib = 2**20
    assert prescan._child_share([10 * mib, 300 * mib, 20 * mib, 250 * mib]) == {1}
    assert prescan._child_share([100 * mib] * 4) == {0, 2}
    assert prescan._child_share([5 * 2**20]) == set()  # nothing left for this process: no child
    assert prescan._child_share([2**20, 2**20 - 1]) == set()  # too small to pay for a process


def test_a_child_that_dies_leaves_the_scans_to_this_process(forks, monkeypatch):
    real = prescan._verdict

    def verdict(data):
        if os.getpid() != PARENT:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(data)

    monkeypatch.setattr(prescan, "_verdict", verdict)
    assert side_by_side(PICKLES) == serial(PICKLES)
    assert len(forks) == 1
    assert reaped(forks)


def test_a_scan_given_up_midway_ends_its_child(forks):
    scans = prescan.scan_all(PICKLES)
    next(scans)
    scans.close()
    assert len(forks) == 1
    assert reaped(forks)


def test_a_fork_that_fails_leaves_the_scans_to_this_process(monkeypatch):
    def fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    monkeypatch.setattr(prescan, "_can_fork", lambda: True)
    monkeypatch.setattr(prescan.os, "fork", fork)
    assert side_by_side(PICKLES) == serial(PICKLES)


def test_without_a_second_core_nothing_is_forked(monkeypatch):
    monkeypatch.setattr(prescan.os, "sched_getaffinity", lambda _: {0})
    monkeypatch.setattr(prescan, "MIN_CHILD_BYTES", 0)
    monkeypatch.setattr(prescan.os, "fork", lambda: pytest.fail("forked"))
    assert side_by_side(PICKLES) == serial(PICKLES)


def test_load_all_gives_what_load_gives_on_a_real_checkpoint(forks, tmp_path):
    """A real DeepSpeed save (committed), a malicious file and a cut copy beside it: the
    states and the errors of ``load_all`` are those of ``load``, file by file."""
    save = tmp_path / "ckpt"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], save)
    files = sorted(tag_dir(save).glob("*.pt"))
    assert len(files) == 3
    evil = tag_dir(save) / "evil.pt"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(print, protocol=2))  # a global not on the allowlist
    cut = tag_dir(save) / "cut.pt"
    cut.write_bytes(files[0].read_bytes()[:-100])
    every = [*files, evil, cut]

    together = StateCache()
    together.load_all(every)
    assert len(forks) == 1
    for path in every:
        one, alone = together.load(path), StateCache().load(path)
        assert (repr(one.state), type(one.error), str(one.error)) == (
            repr(alone.state),
            type(alone.error),
            str(alone.error),
        )
    assert [together.load(p).error is None for p in every] == [True, True, True, False, False]
    assert reaped(forks)


def test_a_refusal_found_by_the_child_reads_as_one_found_here(forks, tmp_path):
    """The child's verdict crosses as text; the error the reader reports from it is the same."""
    paths = []
    for i, data in enumerate([PICKLES[0], PICKLES[1], PICKLES[2], PICKLES[3]]):
        path = tmp_path / f"f{i}.pt"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"f{i}/data.pkl", data)
        paths.append(path)
    together = StateCache()
    together.load_all(paths)
    assert len(forks) == 1
    messages = [str(together.load(p).error) for p in paths]
    assert messages == [str(StateCache().load(p).error) for p in paths]
    assert "memo index" in messages[1] and "nest deeper" in messages[2]


def test_the_callers_work_runs_once_while_the_child_may_still_scan(forks):
    """``meanwhile`` runs in this process after its own share and before the child's verdicts."""
    largest = PICKLES.index(max(PICKLES, key=len))
    seen, ran = [], []
    for i, _ in prescan.scan_all(PICKLES, lambda: ran.append(list(seen))):
        seen.append(i)
    assert len(ran) == 1 and largest not in ran[0]  # before the child's share was given out
    assert sorted(ran[0]) == sorted(
        i for i in range(len(PICKLES)) if i not in prescan._child_share(list(map(len, PICKLES)))
    )
    assert reaped(forks)


def test_without_a_child_the_callers_work_is_left_to_the_caller(monkeypatch):
    monkeypatch.setattr(prescan.os, "sched_getaffinity", lambda _: {0})
    ran = []
    assert [i for i, _ in prescan.scan_all(PICKLES, lambda: ran.append(1))] == list(range(len(PICKLES)))
    assert ran == []
