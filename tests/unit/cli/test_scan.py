"""``ckptspec scan RUN_DIR`` on runs built from the committed real checkpoint (issue #43): each tag's verdict,
the newest valid tag, ``--fix-latest`` (and a kill at every step of it), exit codes and bad input.

The tags are copies of one real DeepSpeed save (tests/data), some damaged: a truncated file, a missing
rank file. tests/export/test_scan.py holds the real run and DeepSpeed's resume from the fixed ``latest``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from _harness.states import points, visible

SOURCE = "s2-bf16-ws2"
OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
OPTIM_0 = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _tag(committed, run: Path, name: str) -> Path:
    tag = run / name
    shutil.copytree(committed(SOURCE) / "global_step2", tag)
    return tag


def _broken_run(committed, run: Path, latest: str | None = "global_step30") -> Path:
    """global_step10 good, global_step20 without rank 1's optimizer file, global_step30 truncated."""
    run.mkdir()
    _tag(committed, run, "global_step10")
    (_tag(committed, run, "global_step20") / OPTIM_1).unlink()
    cut = _tag(committed, run, "global_step30") / OPTIM_0
    cut.write_bytes(cut.read_bytes()[:4000])
    if latest is not None:
        (run / "latest").write_text(latest)
    return run


def _json(ckptspec_process, *args: str) -> tuple[int, dict]:
    done = ckptspec_process(["scan", *args, "--format", "json"])
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("latest", ["global_step30", None, "global_step20", "gone"])
def test_scan_names_the_good_older_tag(committed, ckptspec_process, tmp_path, latest):
    run = _broken_run(committed, tmp_path / "run", latest)
    code, report = _json(ckptspec_process, str(run))
    assert code == 1
    assert report["newest_valid"] == "global_step10"
    assert report["problem"]["code"] == "CK261"
    tags = {t["name"]: t for t in report["tags"]}
    assert [t["name"] for t in report["tags"]] == ["global_step10", "global_step20", "global_step30"]
    assert [t["step"] for t in report["tags"]] == [10, 20, 30]
    assert tags["global_step10"]["valid"] and tags["global_step10"]["kind"] == "zero"
    assert {f["code"] for f in tags["global_step20"]["findings"]} == {"CK206"}
    assert "CK205" in {f["code"] for f in tags["global_step30"]["findings"]}
    assert tags["global_step10"]["size"] == sum(p.stat().st_size for p in (run / "global_step10").iterdir())
    text = ckptspec_process(["scan", str(run), "-q"])
    assert text.returncode == 1 and f"{run}: newest valid tag: global_step10" in text.stdout
    assert "CK261" in text.stderr and "Traceback" not in text.stderr


@pytest.mark.parametrize("latest", ["global_step30", None])
def test_fix_latest_points_at_the_good_tag_and_logs_it(committed, ckptspec_process, tmp_path, latest):
    run = _broken_run(committed, tmp_path / "run", latest)
    tags_before = {n: visible(run / n) for n in ("global_step10", "global_step20", "global_step30")}
    done = ckptspec_process(["scan", str(run), "--fix-latest"])
    assert done.returncode == 0, done.stderr
    assert (run / "latest").read_bytes() == b"global_step10"
    was = "'global_step30'" if latest else "no 'latest'"
    line = f"latest: {was} -> 'global_step10' (the newest valid tag; newer and invalid: global_step20, global_step30)"
    assert f"{run}: {line}" in done.stdout
    assert (run / "ckptspec-scan.log").read_text().splitlines()[0].endswith(line)
    assert {n: visible(run / n) for n in tags_before} == tags_before  # the tags are not touched
    again = ckptspec_process(["scan", str(run), "--fix-latest"])  # nothing left to fix: no second line
    assert again.returncode == 0 and len((run / "ckptspec-scan.log").read_text().splitlines()) == 1


def test_a_valid_run_passes_and_newer_valid_tags_win(committed, ckptspec_process, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("global_step1", "global_step2"):
        _tag(committed, run, name)
    (run / "latest").write_text("global_step2")
    assert _json(ckptspec_process, str(run))[0] == 0
    (run / "latest").write_text("global_step1")  # an older valid tag: a resume would lose a step
    code, report = _json(ckptspec_process, str(run))
    assert code == 1 and report["problem"]["code"] == "CK261" and "older" in report["problem"]["message"]


def test_trainer_folders(committed, ckptspec_process, tmp_path):
    """Hugging Face Trainer's checkpoint-N/ folders, each with a DeepSpeed tag and its own latest."""
    run = tmp_path / "trainer"
    run.mkdir()
    for step in (500, 1000):
        folder = run / f"checkpoint-{step}"
        folder.mkdir()
        _tag(committed, folder, f"global_step{step}")
        (folder / "latest").write_text(f"global_step{step}")
    code, report = _json(ckptspec_process, str(run))
    assert code == 0 and report["newest_valid"] == "checkpoint-1000/global_step1000"
    (run / "checkpoint-1000" / "global_step1000" / OPTIM_1).unlink()
    code, report = _json(ckptspec_process, str(run))
    assert code == 1 and report["newest_valid"] == "checkpoint-500/global_step500"
    assert report["problem"]["code"] == "CK261" and "resume_from_checkpoint=checkpoint-500" in report["problem"]["hint"]
    assert ckptspec_process(["scan", str(run), "--fix-latest"]).returncode == 1  # no `latest` of the run's to fix
    assert not (run / "latest").exists()


def test_no_tag_no_valid_tag_and_bad_input(committed, ckptspec_process, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, report = _json(ckptspec_process, str(empty))
    assert code == 1 and report["problem"]["code"] == "CK260" and report["tags"] == []
    code, report = _json(ckptspec_process, str(committed(SOURCE) / "global_step2"))  # a tag, not its run
    assert code == 1 and report["problem"]["hint"].endswith(": this is a tag directory")
    run = _broken_run(committed, tmp_path / "run")
    shutil.rmtree(run / "global_step10")
    done = ckptspec_process(["scan", str(run), "--fix-latest"])
    assert done.returncode == 1 and "CK260" in done.stderr
    assert (run / "latest").read_text() == "global_step30" and not (run / "ckptspec-scan.log").exists()
    missing = ckptspec_process(["scan", str(tmp_path / "nope")])
    assert missing.returncode == 2 and "CK901" in missing.stderr and "Traceback" not in missing.stderr
    code, report = _json(ckptspec_process, str(tmp_path / "nope"))
    assert code == 2 and report["error"]["code"] == "CK901"
    url = ckptspec_process(["scan", "s3://bucket/run", "--fix-latest"])
    assert url.returncode == 2 and "CK916" in url.stderr


def test_a_kill_during_fix_latest_leaves_latest_old_or_new(committed, crash, tmp_path):
    """SIGKILL at every sampled step of --fix-latest: `latest` names the old tag or the new one, never a part."""
    args = lambda run: ["scan", str(run), "--fix-latest", "-q"]  # noqa: E731
    total = crash.steps(args(_broken_run(committed, tmp_path / "count")), tmp_path / "steps")
    assert total >= 4  # create, write, fsync, rename... of `latest`, then the log's line
    for point in points(total, total):
        run = _broken_run(committed, tmp_path / f"kill-{point}")
        tags = {n: visible(run / n) for n in ("global_step10", "global_step20", "global_step30")}
        assert crash.run(args(run), f"kill:{point}").returncode == -9
        assert (run / "latest").read_bytes() in (b"global_step30", b"global_step10"), point
        assert {n: visible(run / n) for n in tags} == tags
        assert crash.run(args(run)).returncode == 0  # the next run finishes the job
        assert (run / "latest").read_bytes() == b"global_step10"


def _kept_run(committed, run: Path) -> Path:
    """global_step1..3 good (step 2 with a file of the user's), global_step4 without rank 1's optimizer file."""
    run.mkdir()
    for step in (1, 2, 3, 4):
        _tag(committed, run, f"global_step{step}")
    (run / "global_step2" / "notes.txt").write_text("the user's")
    (run / "global_step4" / OPTIM_1).unlink()
    (run / "latest").write_text("global_step3")
    return run


def test_keep_removes_only_tags_with_n_newer_valid_ones(committed, ckptspec_process, tmp_path):
    run = _kept_run(committed, tmp_path / "run")
    before = visible(run)
    code, report = _json(ckptspec_process, str(run), "--keep", "2")  # global_step4 is invalid: only 1 has 2 newer valid
    assert code == 0 and report["removed"] == ["global_step1"] and report["kept"] == {}
    names = ["ckptspec-scan.log", "global_step2", "global_step3", "global_step4", "latest"]
    assert sorted(p.name for p in run.iterdir()) == names
    assert {k: v for k, v in visible(run).items() if not k.startswith("ckptspec-scan")} == {
        k: v for k, v in before.items() if not k.startswith("global_step1/")
    }  # nothing else touched: the invalid newer tag, the user's file, latest
    assert "removed 'global_step1'" in (run / "ckptspec-scan.log").read_text()
    code, report = _json(ckptspec_process, str(run), "--keep", "1")
    assert code == 0 and report["removed"] == []
    assert report["kept"] == {"global_step2": "holds what ckptspec cannot attribute to a tag: notes.txt"}
    assert (run / "global_step2" / "notes.txt").read_text() == "the user's"
    (run / "global_step2" / "notes.txt").unlink()
    code, report = _json(ckptspec_process, str(run), "--keep", "1")
    assert code == 0 and report["removed"] == ["global_step2"] and report["kept"] == {}
    code, report = _json(ckptspec_process, str(run), "--keep", "1")  # global_step3: no newer valid tag
    assert code == 0 and report["removed"] == []


def test_keep_never_removes_what_latest_names(committed, ckptspec_process, tmp_path):
    run = _kept_run(committed, tmp_path / "run")
    (run / "latest").write_text("global_step1")
    code, report = _json(ckptspec_process, str(run), "--keep", "1")
    assert code == 1 and report["problem"]["code"] == "CK261"  # latest names an older tag: said, not fixed
    assert report["removed"] == [] and report["kept"]["global_step1"] == "'latest' names it"
    code, report = _json(ckptspec_process, str(run), "--keep", "1", "--fix-latest")  # fixed first, then kept
    assert code == 0 and report["removed"] == ["global_step1"] and (run / "latest").read_text() == "global_step3"


def test_keep_bad_input(committed, ckptspec_process, tmp_path):
    run = _kept_run(committed, tmp_path / "run")
    for bad in ("0", "-1", "x"):
        done = ckptspec_process(["scan", str(run), "--keep", bad])
        assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (run / "global_step1").is_dir()
    url = ckptspec_process(["scan", "s3://bucket/run", "--keep", "1"])
    assert url.returncode == 2 and "CK916" in url.stderr


def test_a_kill_during_keep_leaves_each_tag_whole_or_gone(committed, crash, tmp_path):
    """SIGKILL at every step of --keep 1 (two tags to remove): every tag in view is byte for byte as it was,
    the older goes first, latest is untouched; the next run removes the hidden remains and finishes."""
    args = lambda run: ["scan", str(run), "--keep", "1", "-q"]  # noqa: E731

    def run_of(name: str) -> Path:
        run = _kept_run(committed, tmp_path / name)
        (run / "global_step2" / "notes.txt").unlink()
        return run

    total = crash.steps(args(run_of("count")), tmp_path / "steps")
    assert total >= 6  # per tag: create, rename, remove (and the log's lines)
    for point in points(total, total):
        run = run_of(f"kill-{point}")
        before = visible(run)
        assert crash.run(args(run), f"kill:{point}").returncode == -9
        tags = {p.name for p in run.iterdir() if p.is_dir() and not p.name.startswith(".")}
        assert tags in ({"global_step1", "global_step2", "global_step3", "global_step4"},
                        {"global_step2", "global_step3", "global_step4"},
                        {"global_step3", "global_step4"}), (point, tags)  # fmt: skip
        seen = {k: v for k, v in visible(run).items() if not k.startswith("ckptspec-scan")}
        assert seen == {k: v for k, v in before.items() if k.split("/")[0] in tags | {"latest"}}, point
        assert crash.run(args(run)).returncode == 0
        assert {p.name for p in run.iterdir()} == {"global_step3", "global_step4", "latest", "ckptspec-scan.log"}


def test_keep_in_a_run_another_ckptspec_run_holds_is_refused(committed, ckptspec_process, tmp_path):
    run = _kept_run(committed, tmp_path / "run")
    fd = os.open(run, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running `scan --keep` holds
        done = ckptspec_process(["scan", str(run), "--keep", "1"])
    finally:
        os.close(fd)
    assert done.returncode == 2 and "CK908" in done.stderr and "Traceback" not in done.stderr
    assert (run / "global_step1").is_dir() and not (run / "ckptspec-scan.log").exists()


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_the_progress_bar_counts_tags(capsys, monkeypatch, with_tqdm):
    from ckptspec.export.progress import progress_printer

    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # the percentage line instead
    update, close = progress_printer(3, True, desc="scan", unit="tag")
    for _ in range(3):
        update(1)
    close()
    err = capsys.readouterr().err
    assert "scan" in err and "/3 " in err and "tag" in err and "MiB" not in err  # tqdm redraws at most every 0.1 s
    if not with_tqdm:
        assert "scan 100% (3/3 tags)" in err
