"""Which processes ``ckptspec.split`` counts as torchrun's ranks: the ones torchrun started, never a process one of
them started (which inherits the same variables; joining the job's group from there waits forever)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptspec import split

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SIZE = "from ckptspec import split; print(split.torchrun_size())"


def _size_seen_by_a_child(parent_env: dict[str, str], child_env: dict[str, str]) -> int:
    """``torchrun_size()`` in a Python child of a Python parent started with ``parent_env``."""
    child = f"subprocess.run([sys.executable, '-c', {SIZE!r}])"
    parent = f"import subprocess, sys, os; os.environ.update({child_env!r}); {child}"
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN and k != "CKPTSPEC_SPLIT"}
    run = subprocess.run(
        [sys.executable, "-c", parent], env={**env, **parent_env}, capture_output=True, text=True, check=True
    )
    return int(run.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="the parent's environment is read from /proc")
def test_a_process_whose_parent_has_no_rank_is_a_rank():
    assert _size_seen_by_a_child({}, TORCHRUN) == 2  # its parent has no RANK, as torchrun's agent has none


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="the parent's environment is read from /proc")
def test_a_process_that_a_rank_started_runs_alone():
    assert _size_seen_by_a_child(TORCHRUN, {}) == 1


def test_ckptspec_split_decides_when_set():
    assert _size_seen_by_a_child(TORCHRUN, {"CKPTSPEC_SPLIT": "1"}) == 2  # e.g. under torchrun --no-python sh -c
    assert _size_seen_by_a_child({}, {**TORCHRUN, "CKPTSPEC_SPLIT": "0"}) == 1


def test_outside_torchrun_there_is_one_process(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPTSPEC_SPLIT", "1")
    assert split.torchrun_size() == 1
