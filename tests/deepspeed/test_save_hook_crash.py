"""``ckptspec.deepspeed.save_checkpoint`` killed at any instant (issue #21, item 3).

A real two-rank DeepSpeed job saves tag ``first``, trains a step, then saves again (a new tag,
or ``first`` once more), and rank 0 is sent SIGKILL at a sampled step of that second save:
during DeepSpeed's own file writes, the sidecar, the rename of the tag directory or ``latest``
(tests/_harness/job/save_crash.py). The checkpoint directory must then hold the earlier save
(``latest`` unchanged, its tag byte for byte as it was) or the new one complete with its
sidecar; DeepSpeed loads both (checked in the job that ran to completion), and the leftovers of
the killed save are what the next save removes (``ckptspec._fs.sweep``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _harness.states import hidden, points, visible
from click.testing import CliRunner

from ckptspec import _commit, _fs
from ckptspec.cli import cli

SPEC = {"stage": 2, "dtype": "bf16", "tied": True, "frozen": True, "buffers": True}
WORLD_SIZE = 2
CASES = {"new-tag": "second", "same-tag": "first"}  # the second save's tag
SAMPLE = {"new-tag": 4, "same-tag": 6}  # kill points per case (all of them: CKPTSPEC_CRASH_ALL=1)


def _killed(name: str, error: Exception, out: Path) -> bool:
    """A launch killed at its kill point is the expected outcome: its log kept beside the save."""
    if name.endswith("-None") or "SIGKILL" not in str(error):
        return False
    (out / "killed.log").write_text(str(error)[-5000:])
    return True


def _build(ds, plans: list[tuple[str, int | None]]) -> dict[tuple, Path]:
    """The entries of ``plans`` ((second tag, kill point or None)), the missing ones built in one go
    (``ds.launched``: a launch each, keyed on the ckptspec modules the job imports)."""
    names = {f"save-crash-{second}-{kill_at}": (second, kill_at) for second, kill_at in plans}
    tasks = {
        name: {"kind": "save_crash", "args": {"spec": SPEC, "second_tag": second, "kill_at": kill_at}}
        for name, (second, kill_at) in names.items()
    }
    built = ds.launched(tasks, WORLD_SIZE, failed_ok=_killed)
    return {plan: built[name] for name, plan in names.items()}


@pytest.fixture(scope="module")
def runs(ds) -> dict:
    """case -> (the save that finished, {kill point: the save that was killed there})."""
    built = _build(ds, [(second, None) for second in CASES.values()])
    complete = {case: built[second, None] for case, second in CASES.items()}
    plans = []
    for case, second in CASES.items():
        total = json.loads((complete[case] / "save" / "steps.json").read_text())["steps"]
        plans += [(case, second, point) for point in points(total, SAMPLE[case])]
    killed = _build(ds, [(second, point) for _, second, point in plans])
    out = {case: (complete[case], {}) for case in CASES}
    for case, second, point in plans:
        out[case][1][point] = killed[second, point]
    return out


def _tag_files(save: Path, tag: str) -> dict[str, bytes]:
    return visible(save / tag)


@pytest.mark.parametrize("case", CASES)
def test_the_complete_saves_load_with_deepspeed(runs, case):
    complete, _ = runs[case]
    loads = json.loads((complete / "save" / "loads.json").read_text())
    assert loads and all(loads.values()), loads


@pytest.mark.parametrize("case", CASES)
def test_a_killed_save_leaves_the_earlier_or_the_new_checkpoint(runs, case, tmp_path):
    complete, killed = runs[case]
    second = CASES[case]
    reference = complete / "save"
    before_first = _tag_files(reference, "first") if second != "first" else None
    assert killed, "no kill point was tried"
    states = []
    for point, entry in sorted(killed.items()):
        assert (entry / "killed.log").exists(), f"step {point}: the job was not killed"
        save = tmp_path / f"at-{point}"
        shutil.copytree(entry / "save", save, symlinks=True)
        latest = (save / "latest").read_text()
        if second == "first":
            # The tag is rewritten in place: it is the whole earlier save or the whole new one.
            state = _tag_files(save, "first")
            assert state, f"step {point}: tag 'first' is missing"
            assert state == _tag_files(reference, "first") or _is_first_save(save, complete), f"step {point}: mixed"
            states.append("new" if state == _tag_files(reference, "first") else "old")
        else:
            assert _tag_files(save, "first") == before_first, f"step {point}: the earlier save changed"
            assert latest in ("first", "second"), f"step {point}: latest names {latest!r}"
            if latest == "second" or (save / "second").exists():
                assert _tag_files(save, "second") == _tag_files(reference, "second"), f"step {point}: partial"
                states.append("new")
            else:
                states.append("old")
        # Whatever state: the checkpoint `latest` names validates clean (its hidden leftovers aside).
        report = CliRunner().invoke(cli, ["validate", str(save), "--format", "json"])
        assert report.exit_code == 0, (point, report.output)
        assert all(f["code"] == "CK224" for f in json.loads(report.stdout)["findings"]), report.stdout
        # The next save removes what the killed one left (its writer is gone).
        _fs.sweep(save)
        for tag_dir in [p for p in save.iterdir() if p.is_dir() and not p.name.startswith(".")]:
            _commit.recover(tag_dir)
            _fs.sweep(tag_dir)
        assert hidden(save) == [], f"step {point}: {hidden(save)}"
    assert "old" in states and "new" in states or len(states) < 3, states


def _is_first_save(save: Path, complete: Path) -> bool:
    """Tag ``first`` as the first save wrote it: the masters it holds are the first save's."""
    import torch

    from ckptspec.export.api import load_state_dict

    masters = torch.load(complete / "save" / "masters.pt", weights_only=True)["first"]
    state = load_state_dict(save, framework="torch", tag="first")
    return all(torch.equal(state[name], tensor) for name, tensor in masters.items())
