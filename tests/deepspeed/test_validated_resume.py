"""The validated resume, ``ckptspec.deepspeed.load_checkpoint``, in a real 2-rank DeepSpeed job (issue #43).

The run is built from the ``save_crash`` job's two real tags (entry ``save-crash-second-None``, shared with
export/test_run_scan.py): ``global_step1`` (``first``) and ``global_step2`` (``second``, one training step later),
``latest`` naming ``global_step2``, which is then corrupted: rank 1's optimizer file cut to half (``truncate``) or
removed (``remove``). One launch of ``_harness/resume_job.py`` runs every scenario, each on a fresh engine whose
frozen parameters and buffers hold values no checkpoint holds, with every file DeepSpeed reads recorded.
"""

from __future__ import annotations

import json

import pytest

SPEC = {"stage": 2, "dtype": "bf16", "tied": True, "frozen": True, "buffers": True}
WORLD_SIZE = 2
SAVE = "save-crash-second-None"
OPTIM_1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
SCENARIOS = {  # name -> (faults, tag, fallback)
    "truncate-strict": ({"global_step2": "truncate"}, None, False),
    "remove-strict": ({"global_step2": "remove"}, None, False),
    "truncate-fallback": ({"global_step2": "truncate"}, None, True),
    "remove-fallback-tag": ({"global_step2": "remove"}, "global_step2", True),
    "none-valid": ({"global_step2": "remove", "global_step1": "truncate"}, None, True),
}
REFUSED = ("truncate-strict", "remove-strict", "none-valid")
RESUMED = ("truncate-fallback", "remove-fallback-tag")
CODE = {"truncate": "CK208", "remove": "CK206"}  # the first finding of each fault: the size recorded, the file missing


@pytest.fixture(scope="module")
def resumed(ds) -> dict:
    """scenario -> [rank 0's result, rank 1's] (resume_job.py's OUT/<name>.rank<R>.json)."""
    task = {"kind": "save_crash", "args": {"spec": SPEC, "second_tag": "second", "kill_at": None}}
    saved = ds.launched({SAVE: task}, WORLD_SIZE)[SAVE] / "save"
    scenarios = [{"name": n, "faults": f, "tag": t, "fallback": b} for n, (f, t, b) in SCENARIOS.items()]
    task = {"kind": "validated_resume", "args": {"spec": SPEC, "load": str(saved), "scenarios": scenarios}}
    out = ds.launched({"validated-resume": task}, WORLD_SIZE)["validated-resume"] / "save"
    return {n: [json.loads((out / f"{n}.rank{r}.json").read_text()) for r in range(WORLD_SIZE)] for n in SCENARIOS}


@pytest.mark.parametrize("name", REFUSED)
def test_every_rank_refuses_before_deepspeed_reads_a_byte(resumed, name):
    """The same error and findings on both ranks; DeepSpeed read no file; masters, frozen parameters and buffers
    are still what the engine held before the call."""
    rank0, rank1 = resumed[name]
    assert rank0["error"] == rank1["error"] and rank0["error"] is not None
    error = rank0["error"]
    assert (error["class"], error["code"]) == ("NoValidTag", "CK260")
    faults = SCENARIOS[name][0]
    tried = {f["file"].split("/")[0] for f in error["findings"]}
    assert tried == set(faults)  # without fallback only global_step2; with it both, each found invalid
    for tag, fault in faults.items():
        codes = {f["code"] for f in error["findings"] if f["file"].startswith(f"{tag}/")}
        assert CODE[fault] in codes and f"{tag}: " in error["message"]
    assert any(f["file"] == f"global_step2/{OPTIM_1}" for f in error["findings"])
    for rank in (rank0, rank1):
        assert rank["read"] == [] and rank["untouched"] and rank["tag"] is None


@pytest.mark.parametrize("name", RESUMED)
def test_fallback_resumes_from_the_older_tag_bit_for_bit(resumed, name):
    """global_step1 loaded on both ranks, DeepSpeed reading its files only; masters equal the saving job's at
    ``first`` and, with the Adam moments, what DeepSpeed's own load of the untouched tag gives, bit for bit."""
    fault = SCENARIOS[name][0]["global_step2"]
    for rank, result in enumerate(resumed[name]):
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
