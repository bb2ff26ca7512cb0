"""``ckptspec scan`` on a real DeepSpeed run, then DeepSpeed resuming from what ``--fix-latest`` chose (issue #43).

The run is the ``save_crash`` job's complete two-tag save (tests/_harness/job/save_crash.py, entry
``save-crash-second-None``, shared with deepspeed/test_save_hook_crash.py): a 2-rank ZeRO-2 bf16 job saves
tag ``first``, trains a step and saves ``second``, and records both tags' fp32 masters (``masters.pt``). No job
saves three steps, and adding that to job/ would re-key every entry, so the run is built here from those two
real tags: ``global_step1`` (``first``, good), ``global_step2`` (``second`` without rank 1's optimizer file),
``global_step3`` (``second`` with its model states cut short), and no ``latest``. A 2-rank ``resume`` job
(job/resume.py, an uncached launch: its key holds the run's path) then runs ``engine.load_checkpoint(RUN)``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptspec.cli import cli

SPEC = {"stage": 2, "dtype": "bf16", "tied": True, "frozen": True, "buffers": True}
WORLD_SIZE = 2
SAVE = "save-crash-second-None"
OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def saved(ds) -> Path:
    task = {"kind": "save_crash", "args": {"spec": SPEC, "second_tag": "second", "kill_at": None}}
    return ds.launched({SAVE: task}, WORLD_SIZE)[SAVE] / "save"


def _run(saved: Path, run: Path) -> Path:
    run.mkdir()
    shutil.copytree(saved / "first", run / "global_step1")
    shutil.copytree(saved / "second", run / "global_step2")
    (run / "global_step2" / OPTIM_1).unlink()
    shutil.copytree(saved / "second", run / "global_step3")
    cut = run / "global_step3" / MODEL
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    # what job/resume.py compares the loaded masters with: those of the tag that should be loaded
    shutil.copy(saved / "masters.pt", run / "masters.pt")
    torch.save(torch.load(saved / "masters.pt", weights_only=True)["first"], run / "live_fp32.pt")
    return run


def _scan(*args) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["scan", *map(str, args), "--format", "json"])
    return result.exit_code, json.loads(result.output)


def test_the_two_saved_tags_differ(saved):
    """So a load of any tag but global_step1's shows in the masters."""
    masters = torch.load(saved / "masters.pt", weights_only=True)
    assert sorted(masters["first"]) == sorted(masters["second"])
    assert any(not torch.equal(masters["first"][n], masters["second"][n]) for n in masters["first"])
    assert json.loads((saved / "loads.json").read_text()) == {"second": True, "first": True}  # both loadable


@pytest.mark.parametrize("latest", [None, "global_step3", "global_step2"])
def test_scan_names_the_good_older_tag(saved, tmp_path, latest):
    run = _run(saved, tmp_path / "run")
    if latest:
        (run / "latest").write_text(latest)
    code, report = _scan(run)
    assert code == 1 and report["problem"]["code"] == "CK261"
    assert report["newest_valid"] == "global_step1" and report["latest"] == latest
    verdicts = {t["name"]: (t["valid"], {f["code"] for f in t["findings"]}) for t in report["tags"]}
    assert verdicts["global_step1"] == (True, set())
    assert verdicts["global_step2"] == (False, {"CK206"})
    assert not verdicts["global_step3"][0] and "CK205" in verdicts["global_step3"][1]
    assert [t["kind"] for t in report["tags"]] == ["zero"] * 3
    hashed_code, hashed = _scan(run, "--hash")
    assert hashed_code == 1 and hashed["newest_valid"] == "global_step1"


def _digest(run: Path) -> str:
    """What a DeepSpeed load of ``run`` reads, hashed (names and bytes; not the scan's log, which holds a time)."""
    h = hashlib.sha256()
    for path in sorted(p for p in run.rglob("*") if p.is_file() and p.name != "ckptspec-scan.log"):
        h.update(str(path.relative_to(run)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def test_deepspeed_resumes_from_the_tag_fix_latest_chose(saved, tmp_path, ds):
    """--fix-latest and --keep 1 together, then a real 2-rank job's plain engine.load_checkpoint(RUN)."""
    run = _run(saved, tmp_path / "run")
    shutil.copytree(saved / "first", run / "global_step0")  # an older good tag, for --keep 1 to remove
    code, report = _scan(run, "--fix-latest", "--keep", "1")
    assert code == 0 and report["fixed"].startswith("latest: no 'latest' -> 'global_step1'")
    assert report["removed"] == ["global_step0"] and not (run / "global_step0").exists()
    assert (run / "latest").read_bytes() == b"global_step1"
    assert "-> 'global_step1'" in (run / "ckptspec-scan.log").read_text()

    name = "scan-resume"  # keyed on the task, whose `load` is named for what the run holds: built again on a change
    load = Path(tempfile.gettempdir()) / f"ckptspec-scan-run-{_digest(run)}"
    shutil.rmtree(load, ignore_errors=True)
    shutil.copytree(run, load)
    try:
        task = {"kind": "resume", "args": {"spec": SPEC, "load": str(load)}}
        resumed = json.loads((ds.launched({name: task}, WORLD_SIZE)[name] / "save" / "resume.json").read_text())
    finally:
        shutil.rmtree(load, ignore_errors=True)
    assert resumed["error"] is None and resumed["loaded"]
    assert resumed["mismatched"] == [] and resumed["consistent"]  # every fp32 master equals global_step1's


KINDS = {  # a real run of each kind (read in place: scan without --fix-latest or --keep writes nothing)
    "uc-s2-bf16-ws2": {"global_step2": "zero", "global_step2_universal": "universal"},
    "tp2dp2-s2-bf16-ws4": {"global_step2": "model_parallel", "global_step2_universal": "universal"},
    "moe-ep2-s1-fp32-ws4": {"global_step2": "moe"},
    "pp2-s0-bf16-ws2": {"global_step2": "pipeline_stage0"},
}


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_is_a_tag(ds, name):
    """Universal folders are listed and checked, but `latest` names a tag of the run's own (a job loads a universal
    folder through `latest_universal`)."""
    run = ds.path(name)
    code, report = _scan(run)
    assert code == 0 and report["problem"] is None
    assert {t["name"]: t["kind"] for t in report["tags"]} == KINDS[name]
    assert all(t["valid"] and t["step"] == 2 for t in report["tags"])
    assert report["newest_valid"] == report["latest"] == "global_step2"
