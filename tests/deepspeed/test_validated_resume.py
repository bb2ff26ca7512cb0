"""The validated resume, ``ckptspec.deepspeed.load_checkpoint``, in real 2-rank DeepSpeed jobs (issue #43).

Each run is built from a ``save_crash`` job's two real tags (ZeRO-2 bf16: entry ``save-crash-second-None``, shared
with export/test_run_scan.py; ZeRO-3 bf16: ``save-crash-second-None-s3``): ``global_step1`` (``first``) and
``global_step2`` (``second``, one training step later), ``latest`` naming ``global_step2``, which is then damaged:
rank 1's optimizer file cut to half (``truncate``), or rank 1's optimizer file (ZeRO-2) or model states (ZeRO-3)
removed (``remove``). One launch of ``_harness/resume_job.py`` per stage runs every scenario, each on a fresh engine
whose frozen parameters and buffers hold values no checkpoint holds, with every file DeepSpeed reads recorded."""

from __future__ import annotations

import json

import pytest

WORLD_SIZE = 2
OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
RUNS = {  # ZeRO stage -> (the save_crash job's spec and entry, the file each fault damages in global_step2)
    2: ({"stage": 2, "dtype": "bf16", "tied": True, "frozen": True, "buffers": True}, "save-crash-second-None"),
    3: ({"stage": 3, "dtype": "bf16", "tied": True, "frozen": True, "buffers": True}, "save-crash-second-None-s3"),
}
FILES = {  # stage -> fault -> the rank-1 file it damages: its optimizer state, or at ZeRO-3 its model states
    2: {"truncate": OPTIM_1, "remove": OPTIM_1},
    3: {"truncate": OPTIM_1, "remove": "zero_pp_rank_1_mp_rank_00_model_states.pt"},
}
SCENARIOS = {  # name -> (faults: tag -> fault, tag, fallback)
    "truncate-strict": ({"global_step2": "truncate"}, None, False),
    "remove-strict": ({"global_step2": "remove"}, None, False),
    "truncate-fallback": ({"global_step2": "truncate"}, None, True),
    "remove-fallback-tag": ({"global_step2": "remove"}, "global_step2", True),
    "none-valid": ({"global_step2": "remove", "global_step1": "truncate"}, None, True),
}
REFUSED = ("truncate-strict", "remove-strict", "none-valid")
RESUMED = ("truncate-fallback", "remove-fallback-tag")
CODE = {"truncate": "CK208", "remove": "CK206"}  # the first finding of each fault: the size recorded, the file missing


@pytest.fixture(scope="module", params=sorted(RUNS), ids=lambda stage: f"s{stage}")
def resumed(ds, request) -> tuple[int, dict]:
    """(stage, scenario -> [rank 0's result, rank 1's]) (resume_job.py's OUT/<name>.rank<R>.json): one save_crash
    launch and one validated_resume launch per stage."""
    stage = request.param
    spec, save = RUNS[stage]
    task = {"kind": "save_crash", "args": {"spec": spec, "second_tag": "second", "kill_at": None}}
    saved = ds.launched({save: task}, WORLD_SIZE)[save] / "save"
    scenarios = [
        {"name": n, "faults": {t: [f, FILES[stage][f]] for t, f in faults.items()}, "tag": tag, "fallback": fallback}
        for n, (faults, tag, fallback) in SCENARIOS.items()
    ]
    task = {"kind": "validated_resume", "args": {"spec": spec, "load": str(saved), "scenarios": scenarios}}
    name = f"validated-resume-s{stage}"
    out = ds.launched({name: task}, WORLD_SIZE)[name] / "save"
    results = {n: [json.loads((out / f"{n}.rank{r}.json").read_text()) for r in range(WORLD_SIZE)] for n in SCENARIOS}
    return stage, results


@pytest.mark.parametrize("name", REFUSED)
def test_every_rank_refuses_before_deepspeed_reads_a_byte(resumed, name):
    """The same error and findings on both ranks; DeepSpeed read no file; masters, frozen parameters and buffers
    are still what the engine held before the call."""
    stage, results = resumed
    rank0, rank1 = results[name]
    assert rank0["error"] == rank1["error"] and rank0["error"] is not None
    error = rank0["error"]
    assert (error["class"], error["code"]) == ("NoValidTag", "CK260")
    faults = SCENARIOS[name][0]
    tried = {f["file"].split("/")[0] for f in error["findings"]}
    assert tried == set(faults)  # without fallback only global_step2; with it both, each found invalid
    for tag, fault in faults.items():
        codes = {f["code"] for f in error["findings"] if f["file"].startswith(f"{tag}/")}
        assert CODE[fault] in codes and f"{tag}: " in error["message"]
    damaged = FILES[stage][faults["global_step2"]]
    assert any(f["file"] == f"global_step2/{damaged}" for f in error["findings"])
    for rank in (rank0, rank1):
        assert rank["read"] == [] and rank["untouched"] and rank["tag"] is None


@pytest.mark.parametrize("name", RESUMED)
def test_fallback_resumes_from_the_older_tag_bit_for_bit(resumed, name):
    """global_step1 loaded on both ranks, DeepSpeed reading its files only; masters equal the saving job's at
    ``first`` and, with the Adam moments, what DeepSpeed's own load of the untouched tag gives, bit for bit."""
    fault = SCENARIOS[name][0]["global_step2"]
    for rank, result in enumerate(resumed[1][name]):
        assert result["error"] is None and result["tag"] == "global_step1"
        assert result["skipped"] == [["global_step2", CODE[fault]]]
        assert result["read"] and all(path.startswith("global_step1/") for path in result["read"])
        assert result["first_mismatched"] == [] and not result["untouched"]
        assert result["getter_fp32_mismatched"] == [] and result["getter_optim_mismatched"] == []
        assert "ckptspec_manifest" not in result["client_state"]
        if rank == 0:
            [warning] = result["warned"]
            assert "resuming from global_step1" in warning and f"global_step2 ({CODE[fault]}:" in warning
        else:
            assert result["warned"] == []  # rank 0 says it, once


class _Engine:
    """What load_checkpoint asks of the engine, recorded (outside a distributed job: this process validates)."""

    def __init__(self, universal=False):
        self.calls, self.universal = [], universal

    def load_universal_checkpoint(self):
        return self.universal

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        self.calls.append((load_dir, tag, kwargs))
        return f"{load_dir}/{tag}", {"ckptspec_manifest": "{}", "step": 7}


@pytest.fixture
def run(committed, tmp_path):
    """global_step1 good, global_step2 without rank 1's optimizer file."""
    import shutil

    run = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(committed("s2-bf16-ws2") / "global_step2", run / f"global_step{step}")
    (run / "global_step2" / OPTIM_1).unlink()
    (run / "latest").write_text("global_step2")
    return run


def test_the_engine_is_asked_for_the_tag_chosen_by_name(run):
    """One call of engine.load_checkpoint, with the tag chosen and the caller's own arguments; its client state
    without the save hook's manifest; the skipped tag warned about."""
    from ckptspec.deepspeed import load_checkpoint

    engine = _Engine()
    with pytest.warns(UserWarning, match=r"resuming from global_step1 of .*; skipped global_step2 \(CK206: "):
        resumed = load_checkpoint(engine, run, load_optimizer_states=False)
    assert engine.calls == [(str(run), "global_step1", {"load_optimizer_states": False})]
    assert (resumed.load_path, resumed.tag) == (f"{run}/global_step1", "global_step1")
    assert resumed.client_state == {"step": 7}
    [skipped] = resumed.skipped
    assert (skipped.tag, skipped.code) == ("global_step2", "CK206")
    assert [f.file for f in skipped.findings] == [f"global_step2/{OPTIM_1}"]


def test_refusals_ask_nothing_of_the_engine(run):
    from ckptspec import NoValidTag, UnsupportedEngine
    from ckptspec.deepspeed import load_checkpoint

    engine = _Engine()
    with pytest.raises(NoValidTag):
        load_checkpoint(engine, run, fallback=False)
    with pytest.raises(ValueError, match="is a URL: DeepSpeed's load_checkpoint reads local files"):
        load_checkpoint(engine, "s3://bucket/run")
    with pytest.raises(UnsupportedEngine, match="checkpoint.load_universal"):
        load_checkpoint(_Engine(universal=True), run)
    assert engine.calls == []
