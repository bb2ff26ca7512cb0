"""Forking is opt-in (``ckptspec._forked``): the library never forks its caller unless
``CKPTSPEC_WORKERS`` asks for it, the CLI forks itself unless ``CKPTSPEC_WORKERS=1``, and the save
hook never forks inside a training rank, whatever is set; the results are the same either way.

Each case runs in a fresh, single-threaded process (pytest's own threads would forbid every fork)
that counts the forks made (``os.register_at_fork``), on the committed DeepSpeed checkpoint, with
the size thresholds of the forked paths at 0 so that this small checkpoint crosses them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = COMMITTED["s2-bf16-ws2"]

# Printed last by every case: how many forks the process made, as JSON on stderr's last line.
PRELUDE = """
import atexit, json, os, sys
forks = []
os.register_at_fork(after_in_parent=lambda: forks.append(1))
atexit.register(lambda: print(json.dumps({"forks": len(forks)}), file=sys.stderr, flush=True))
from ckptspec.checkpoint import prescan, states
prescan.MIN_CHILD_BYTES = 0
states.CHECK_APART_BYTES = 0
"""

LIBRARY = """
import hashlib
import ckptspec
state = ckptspec.load_state_dict(sys.argv[1], "numpy")
print(hashlib.sha256(b"".join(name.encode() + a.tobytes() for name, a in sorted(state.items()))).hexdigest())
"""

CLI = """
from ckptspec.cli import run
sys.argv = ["ckptspec", "validate", sys.argv[1], "--format", "json"]
run()
"""

# The hook's first look at the engine reads the checkpoint's files as a save reads its own
# (every forked path of ``StateCache.load_all``), then stops the save: nothing is written.
HOOK = """
import ckptspec.deepspeed
from ckptspec.checkpoint.states import StateCache
tag_dir = [p for p in __import__("pathlib").Path(sys.argv[1]).iterdir() if p.is_dir()][0]
files = sorted(tag_dir.glob("*.pt"))

class Stop(Exception):
    pass

class Engine:
    @property
    def checkpoint_engine(self):
        StateCache().load_all(files)
        print(json.dumps({"inside": len(forks)}), file=sys.stderr)
        raise Stop

try:
    ckptspec.deepspeed.save_checkpoint(Engine(), "/nonexistent-save-dir")
except Stop:
    pass
StateCache().load_all(files)  # the same reads outside the hook
"""


def run(script: str, workers: str | None) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTSPEC_WORKERS"}
    if workers is not None:
        env["CKPTSPEC_WORKERS"] = workers
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + script, str(CHECKPOINT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    return reports, done.stdout


def forks(script: str, workers: str | None) -> int:
    return run(script, workers)[0][-1]["forks"]


@pytest.mark.parametrize("workers", [None, "1", "0", "many"])
def test_the_library_never_forks_unless_asked(workers):
    """``load_state_dict`` validates (prescan, tree checks) past every threshold without a fork:
    unset, 1, and values that are not a positive integer all mean the library's default."""
    assert forks(LIBRARY, workers) == 0


def test_the_library_forks_when_asked_and_loads_the_same_weights():
    (asked, loaded_apart), (alone, loaded_here) = run(LIBRARY, "2"), run(LIBRARY, None)
    assert asked[-1]["forks"] > 0 and alone[-1]["forks"] == 0
    assert loaded_apart == loaded_here  # the same weights, byte for byte


def test_the_cli_forks_itself_unless_told_not_to():
    (forked, out_forked), (alone, out_alone) = run(CLI, None), run(CLI, "1")
    assert forked[-1]["forks"] > 0 and alone[-1]["forks"] == 0
    assert json.loads(out_forked) == json.loads(out_alone)  # the same findings either way


def test_the_save_hook_never_forks_even_when_asked():
    """With ``CKPTSPEC_WORKERS=2`` the reads that fork outside the hook do not fork inside it."""
    pytest.importorskip("torch")  # the hook imports torch.distributed before it looks at the engine
    reports, _ = run(HOOK, "2")
    assert reports[0]["inside"] == 0
    assert reports[-1]["forks"] > 0  # the same reads after the hook did fork: the switch was on
