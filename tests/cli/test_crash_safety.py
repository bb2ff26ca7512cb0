"""Every ckptspec writer killed at sampled steps of its writes, or failing there (issue #21).

For each writer, on a real checkpoint: the state before (S0) and the state a complete run leaves
(S1) are taken first; then the command runs again from S0 and is stopped at a step of its
writes (``tests/_harness/crash.py``):

* SIGKILL: what a reader sees is S0 or S1, or an unfinished commit whose roll-forward (what the
  next writer does first) gives S1; running the command again then leaves exactly S1 and
  nothing hidden behind (the killed run's temporaries are removed: their writer is gone);
* a full disk (ENOSPC) at that step: exit 2 (CK906), the same old-or-new state, and none of the
  failed run's temporaries left.

``CKPTSPEC_CRASH_ALL=1`` tries every step instead of a sample.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _harness.states import points, visible

from ckptspec import _commit, _fs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"


@dataclass
class Writer:
    """A command that writes into ``watched`` (relative to a scratch directory set up by ``prepare``)."""

    args: Callable[[Path], list]  # the command's arguments, given the scratch directory
    watched: str  # the directory whose state the invariants are about
    prepare: Callable[[Path, object, object], None]  # fills the scratch directory (S0), given ds and crash


def _copy_checkpoint(name: str):
    def prepare(scratch: Path, ds, crash) -> None:
        shutil.copytree(ds.path(name), scratch / "ckpt", symlinks=True)

    return prepare


def _with_earlier_output(scratch: Path, ds, crash) -> None:
    _copy_checkpoint("s2-bf16-ws2")(scratch, ds, crash)
    done = crash.run(["reconstruct", scratch / "ckpt", scratch / "out", "-q", "--max-shard-size", "2K"])
    assert done.returncode == 0, done.stderr


def _checkpoint_and_out(scratch: Path, ds, crash) -> None:
    _copy_checkpoint("s2-bf16-ws2")(scratch, ds, crash)
    (scratch / "out").mkdir()
    (scratch / "out" / "m.json").write_text("an earlier manifest the run replaces")


def _embedded_checkpoint_and_out(scratch: Path, ds, crash) -> None:
    _copy_checkpoint("embed-s1-fp16-ws2")(scratch, ds, crash)  # saved by the hook: it carries its manifest
    (scratch / "out").mkdir()
    (scratch / "out" / "m.json").write_text("an earlier manifest the run replaces")


def _example_manifest(scratch: Path, ds, crash) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE, scratch / "in.json")
    (scratch / "out").mkdir()
    (scratch / "out" / "m.msgpack").write_bytes(b"an earlier file the run replaces")


WRITERS = {
    "reconstruct": Writer(
        lambda d: ["reconstruct", d / "ckpt", d / "out", "-q"], "out", _copy_checkpoint("s2-bf16-ws2")
    ),
    "reconstruct-sharded-over-torch": Writer(
        lambda d: ["reconstruct", d / "ckpt", d / "out", "-q", "--format", "torch"], "out", _with_earlier_output
    ),
    "reconstruct-optimizer-state": Writer(
        lambda d: ["reconstruct", d / "ckpt", d / "out", "-q", "--optimizer-state"], "out", _with_earlier_output
    ),
    "embed": Writer(lambda d: ["embed", d / "ckpt"], "ckpt/global_step2", _copy_checkpoint("s3-bf16-ws2-sub")),
    "generate": Writer(lambda d: ["generate", d / "ckpt", "-o", d / "out" / "m.json"], "out", _checkpoint_and_out),
    "extract": Writer(
        lambda d: ["extract", d / "ckpt", "-o", d / "out" / "m.json"], "out", _embedded_checkpoint_and_out
    ),
    "convert": Writer(lambda d: ["convert", d / "in.json", d / "out" / "m.msgpack"], "out", _example_manifest),
    "migrate": Writer(
        lambda d: ["migrate", d / "in.json", d / "out" / "m.msgpack", "--to", "1.0"], "out", _example_manifest
    ),
}


@pytest.fixture(scope="module")
def baselines(crash, ds, tmp_path_factory) -> dict:
    """writer -> (S0, S1, number of write steps, a directory set up once in S0 that each run copies).

    Set up once: a writer whose S0 holds an earlier output ran a whole reconstruct for each of its
    ~45 runs to make it (a fifth of this module's commands); the copy has the same files, bytes
    and modes (S0 compared below as before)."""
    out = {}
    for name, writer in WRITERS.items():
        template = tmp_path_factory.mktemp(f"s0-{name}")
        writer.prepare(template, ds, crash)
        scratch = _fresh(template, tmp_path_factory.mktemp(f"base-{name}") / "scratch")
        before = visible(scratch / writer.watched)
        assert before == visible(template / writer.watched)
        total = crash.steps(writer.args(scratch), scratch.parent / f"{name}-count")
        out[name] = (before, visible(scratch / writer.watched), total, template)
    return out


def _fresh(template: Path, path: Path) -> Path:
    shutil.copytree(template, path, symlinks=True)
    return path


def _old_or_new(watched: Path, before: dict, after: dict, point: int) -> str:
    """What a reader sees is the old state or the new one, or a commit whose roll-forward (what
    the next writer does first) gives the new one."""
    if (watched / _fs.JOURNAL).exists():
        _commit.recover(watched)
        assert visible(watched) == after, f"step {point}: the roll-forward does not give the new state"
        return "after"
    state = visible(watched)
    assert state in (before, after), f"step {point}: neither before nor after, and no commit to finish"
    return "before" if state == before else "after"


@pytest.mark.parametrize("name", WRITERS)
def test_killed_at_any_step(crash, name, baselines, tmp_path):
    writer = WRITERS[name]
    before, after, total, template = baselines[name]
    assert before != after, "the writer changes nothing: the test proves nothing"
    seen = set()
    for point in points(total):
        scratch = _fresh(template, tmp_path / f"kill-{point}")
        watched = scratch / writer.watched
        result = crash.run(writer.args(scratch), f"kill:{point}")
        assert result.returncode == -9, (point, result.returncode, result.stderr[-2000:])
        seen.add(_old_or_new(watched, before, after, point))
        again = crash.run(writer.args(scratch))
        assert again.returncode == 0, (point, again.stderr)
        assert visible(watched) == after, f"step {point}: the next run does not leave the complete output"
        assert _leftovers(watched) == [], f"step {point}: left behind {_leftovers(watched)}"
    assert seen == {"before", "after"}, seen


@pytest.mark.parametrize("name", WRITERS)
def test_a_failed_write_leaves_the_directory_as_it_was(crash, name, baselines, tmp_path):
    """A full disk at a step: exit 2 with CK906, and the same old-or-new invariant, with no
    temporary left behind (a failing run removes its own)."""
    writer = WRITERS[name]
    before, after, total, template = baselines[name]
    for point in points(total, sample=5):
        scratch = _fresh(template, tmp_path / f"enospc-{point}")
        watched = scratch / writer.watched
        result = crash.run(writer.args(scratch), f"enospc:{point}")
        assert result.returncode == 2 and "CK906" in result.stderr, (point, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        _old_or_new(watched, before, after, point)
        assert _leftovers(watched) == [], f"step {point}: left behind {_leftovers(watched)}"


@pytest.mark.parametrize("name", WRITERS)
@pytest.mark.parametrize("how,code,word", [("int", 130, "interrupted"), ("term", 143, "terminated")])
def test_an_interrupted_run_says_what_it_left(crash, name, how, code, word, baselines, tmp_path):
    """Ctrl-C or SIGTERM at a step, the last ones (the commit, or a file's rename) all tried: the run
    removes its temporaries and says what it left, which is the old state ("nothing was written")
    or, stopped while committing, the new one (it finishes the renames first). Never a journal left
    for the next run (#37 item 11: was "nothing was written" over a half-done commit)."""
    writer = WRITERS[name]
    before, after, total, template = baselines[name]
    said = set()
    # The last 12 steps (the commit) with SIGTERM; Ctrl-C unwinds the same way (both are BaseExceptions raised in the
    # main thread, cli.main), so it tries the last 3 and the sample only: 70 fewer runs of the module's 450.
    last = 12 if how == "term" else 3
    for point in sorted(set(points(total, sample=4)) | set(range(max(1, total - last + 1), total + 1))):
        scratch = _fresh(template, tmp_path / f"{how}-{point}")
        watched = scratch / writer.watched
        result = crash.run(writer.args(scratch), f"{how}:{point}")
        assert result.returncode == code, (point, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        line = result.stderr.strip().splitlines()[-1]
        if line == f"{word}; nothing was written":
            assert visible(watched) == before, f"step {point}: {line!r}, but the output changed"
            said.add("nothing")
        else:
            assert line.startswith(f"{word}; ") and line.endswith(
                "holds the complete new output (it was being committed, and that was finished first)"
            ), (point, line)
            assert visible(watched) == after, f"step {point}: {line!r}, but the output is not the new one"
            said.add("complete")
        assert _leftovers(watched) == [], f"step {point}: left behind {_leftovers(watched)}"
    assert said == {"nothing", "complete"}, said


def _leftovers(directory: Path) -> list[str]:
    """What a run left: ckptspec's temporaries and journals (other hidden files are not ours)."""
    return sorted(p.name for p in _fs.leftovers(directory))


def test_the_sample_covers_the_commit(baselines):
    """The sampled steps include the last ones, where the renames of a commit happen."""
    for name, (_, _, total, _) in baselines.items():
        assert total in points(total) and total - 1 in points(total), name
