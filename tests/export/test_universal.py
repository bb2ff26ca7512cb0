"""``ckptspec export-universal`` against real DeepSpeed ``load_universal`` resumes (issue #15, item 2).

Ground truth: tests/_harness/reshard_job.py with ``universal`` (scenarios.UNIVERSAL_CASES). Rank 0 of a
job of the target layout converts a MATRIX checkpoint to DeepSpeed's universal folder, with ckptspec or
with DeepSpeed's own ``ds_to_universal``; every rank loads it with ``checkpoint.load_universal: true``
and the job compares what DeepSpeed loaded with the source job's live values (``live_fp32.pt``,
``live_optim.pt``), then takes one more step (against NATIVE_RESUMES, the job that never stopped).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from _harness.parallel_oracles import bits_equal
from _harness.scenarios import MATRIX_SPECS, UNIVERSAL_CASES
from click.testing import CliRunner

from ckptspec.cli import cli

OURS = sorted(n for n, case in UNIVERSAL_CASES.items() if case[3] == "ckptspec")
STEP_TOLERANCE = {"bf16": 1e-3, "fp16": 1e-4, "fp32": 1e-5}  # as test_reshard.py: another world size or layout


@pytest.mark.parametrize("case", OURS)
def test_load_universal_gives_the_source_state_bit_for_bit(case, ds):
    outcome = ds.read_json(case, "resume.json")
    assert outcome["reshard_error"] is None and outcome["error"] is None, outcome
    assert outcome["loaded"] and outcome["consistent"], outcome["mismatched"]
    assert outcome["optim_consistent"], outcome["optim_mismatched"]
    assert outcome["getter_fp32_mismatched"] == [] and outcome["getter_optim_mismatched"] == [], outcome
    assert outcome["global_steps"] == 2 and outcome["skipped_steps"] == 0
    # DeepSpeed's universal load restores trainable parameters only: it never loads the module, so the buffers keep
    # what the job put there before loading (before_load.py), and the frozen parameters the job's own (kept: built
    # from the source's seed, they are the source's whatever the folder holds; the folder holds none)
    assert outcome["frozen_checked"] == ["frozen.bias", "frozen.weight"]
    assert outcome["buffers_checked"] == ["running", "step_count"]
    assert outcome["model_mismatched"] == ["running", "step_count"], outcome["model_mismatched"]


@pytest.mark.parametrize("case", OURS)
def test_one_more_step_after_load_universal_equals_the_job_that_never_stopped(case, ds):
    import torch

    source = UNIVERSAL_CASES[case][0]
    resumed = torch.load(ds.path(case) / "after_step.pt", weights_only=True)
    never_stopped = torch.load(ds.path(f"native-{source}") / "after_step.pt", weights_only=True)
    assert resumed.keys() == never_stopped.keys()
    worst = max((resumed[n] - never_stopped[n]).abs().max().item() for n in never_stopped)
    assert worst <= STEP_TOLERANCE[MATRIX_SPECS[source][0]["dtype"]], worst


def _folder_errors(folder, source) -> dict[str, float]:
    """Each tensor of a universal folder against the source job's live value: max |diff| (nan: missing)."""
    import torch

    live = torch.load(source / "live_fp32.pt", weights_only=True)
    optim = torch.load(source / "live_optim.pt", weights_only=True)
    out = {}
    for name, master in live.items():
        wanted = {"fp32": master.float(), **optim["state"].get(name, {})}
        for key, value in wanted.items():
            path = folder / "zero" / name / f"{key}.pt"
            if not path.exists():
                out[f"{name}.{key}"] = math.nan
                continue
            got = torch.load(path, weights_only=False)["param"].view(value.shape)
            out[f"{name}.{key}"] = (got - value).abs().max().item()
    return out


def test_round_robin_side_by_side_deepspeeds_universal_folder_is_wrong_and_ckptspecs_is_not(ds):
    """The same round-robin checkpoint (ZeRO-2 fp32, 3 ranks), converted by both tools and loaded by the
    same job (3 ranks, no round robin). DeepSpeed 0.19.8's ds_to_universal reads positions from
    param_slice_mappings, which under round robin are natural-order offsets: every parameter the reorder
    moved gets another parameter's values (observed: masters off by up to 0.42, moments by up to 0.026)."""
    source = ds.path("s2-fp32-ws3-rr")
    theirs_case, ours_case = "universal-ds-s2-fp32-rr-3to3-plain", "universal-s2-fp32-rr-3to3-plain"
    theirs = _folder_errors(ds.path(theirs_case) / "uc" / "global_step2_universal", source)
    ours = _folder_errors(ds.path(ours_case) / "uc" / "global_step2_universal", source)
    assert all(v == 0.0 for v in ours.values()), ours
    moved = {"l1.weight", "l1.bias", "l2.weight", "l2.bias"}
    wrong = {k.rsplit(".", 1)[0] for k, v in theirs.items() if v > 0.1 and k.endswith(".fp32")}
    assert wrong == moved, theirs
    assert theirs["emb.weight.fp32"] == 0.0  # the first parameter stays where it was
    loaded_ours, loaded_theirs = ds.read_json(ours_case, "resume.json"), ds.read_json(theirs_case, "resume.json")
    assert loaded_ours["consistent"] and loaded_ours["optim_consistent"], loaded_ours
    assert set(loaded_theirs["mismatched"]) == moved and loaded_theirs["max_abs_diff"] > 0.1, loaded_theirs


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_an_invalid_source_is_refused_and_nothing_written(ds, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ds.path("s2-bf16-ws2"), source)
    victim = source / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])
    result = _run("export-universal", source, tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "nothing was written" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _files(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_the_bf16_optimizer_folder_is_ds_to_universals_file_for_file(ds):
    """DeepSpeed's BF16_Optimizer (bf16, grad_accum_dtype fp32, stage 1), the checkpoint ds_to_universal was written
    for: export-universal's folder against ds_to_universal's of the same tag (both written by the jobs that loaded
    them, UNIVERSAL_CASES). Every trainable parameter's master, moments and step bit for bit, ``cat_dim`` 0, the same
    ``optimizer_state.pt`` and the model states byte for byte. Where they differ, they differ as every data-parallel
    folder does: ds_to_universal writes the buffers and the module's bf16 weights for the tie and frozen parameters
    (no ``cat_dim``), ckptspec the tie as its owner (master, moments, step) and no buffer; a universal load reads
    neither (both jobs hold the same bits)."""
    import torch

    ours = ds.path("universal-s1-bf16opt-2to3") / "uc" / "global_step2_universal"
    theirs = ds.path("universal-ds-s1-bf16opt-2to3") / "uc" / "global_step2_universal"
    tie = {f"zero/head.weight/{f}.pt" for f in ("exp_avg", "exp_avg_sq", "step")}
    assert _files(ours) - _files(theirs) == tie
    assert _files(theirs) - _files(ours) == {"zero/running/fp32.pt", "zero/step_count/fp32.pt"}
    compared = 0
    for name in sorted(_files(ours) & _files(theirs)):
        if name == "mp_rank_00_model_states.pt":
            assert (ours / name).read_bytes() == (theirs / name).read_bytes()
            continue
        a, b = torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False)
        if name == "zero/optimizer_state.pt":
            assert repr(a) == repr(b) and "loss_scaler" not in a and a["group_paddings"] == [0], (a, b)
        elif name.endswith("/step.pt"):
            assert bits_equal(a, b) and a.item() == 2, name
        elif name.startswith(("zero/frozen.", "zero/head.weight/")):  # the module's weight, no cat_dim
            assert a.pop("cat_dim") == 0 and list(b) == ["param"], (name, b)
            assert bits_equal(a["param"], b["param"]) == name.startswith("zero/frozen."), name
        else:
            assert bits_equal(a.pop("param"), b.pop("param")), name
            assert a == b == {"cat_dim": 0}, (name, a, b)
            compared += 1
    assert compared == 5 * 3  # emb, l1, l2 weights and biases: fp32, exp_avg, exp_avg_sq
    # the tie's master, which ds_to_universal leaves out (it writes the bf16 weight): emb.weight's, bit for bit
    tied = torch.load(ours / "zero/head.weight/fp32.pt", weights_only=False)["param"]
    assert bits_equal(tied, torch.load(ours / "zero/emb.weight/fp32.pt", weights_only=False)["param"])


def _reconstructed(folder, out) -> tuple[dict, dict]:
    """(tensors, __metadata__) of ``ckptspec reconstruct folder out``."""
    from safetensors import safe_open

    result = _run("reconstruct", folder, out, "--quiet")
    assert result.exit_code == 0, result.output
    with safe_open(out / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("source", ["s2-bf16-ws2", "s3-bf16-ws2-sub", "s2-fp32-ws3-rr"])
def test_a_universal_folder_reconstructs_to_its_sources_whole_model(source, ds, tmp_path):
    """issue #37 M1: the universal folder of a model with buffers, a tie and frozen parameters, as
    ``export-universal`` writes it, reconstructs to what its source reconstructs to: the buffers (from
    the copied model states, in their own dtypes), the tie as a tie (``ckptspec.aliases``, stored once),
    every other tensor bit for bit. An earlier ckptspec dropped the buffers and wrote the tie as a copy."""
    folder = tmp_path / "uc"
    assert _run("export-universal", ds.path(source), folder).exit_code == 0
    got, meta = _reconstructed(folder, tmp_path / "from_uc")
    want, want_meta = _reconstructed(ds.path(source), tmp_path / "from_source")
    assert sorted(got) == sorted(want)
    assert [n for n in want if not bits_equal(got[n], want[n])] == []
    assert (
        json.loads(meta["ckptspec.aliases"])
        == json.loads(want_meta["ckptspec.aliases"])
        == {"head.weight": "emb.weight"}
    )
    sources = json.loads(meta["ckptspec.sources"])
    assert sources["buffer"] == ["running", "step_count"] and "head.weight" not in got


def test_deepspeeds_universal_folder_keeps_the_buffers_and_the_tie(ds, tmp_path):
    """DeepSpeed's own ds_to_universal folder (of s2-fp32-ws3-rr) writes zero/<buffer>/fp32.pt too (its
    int64 step counter cast to fp32) and the tied alias's own fp32.pt: the reconstruction takes the
    buffers from the copied model states as saved, the alias as its owner's tie, every parameter from
    DeepSpeed's fp32.pt (read with torch here; l1/l2 hold DeepSpeed's round-robin misplacement, above)."""
    import torch

    folder = ds.path("universal-ds-s2-fp32-rr-3to3-plain") / "uc" / "global_step2_universal"
    got, meta = _reconstructed(folder, tmp_path / "from_uc")
    want, _ = _reconstructed(ds.path("s2-fp32-ws3-rr"), tmp_path / "from_source")
    assert sorted(got) == sorted(want)
    assert json.loads(meta["ckptspec.aliases"]) == {"head.weight": "emb.weight"}
    assert got["step_count"].dtype == torch.int64
    for name in ("running", "step_count"):
        assert bits_equal(got[name], want[name]), name
    for name in set(got) - {"running", "step_count"}:
        fp32 = torch.load(folder / "zero" / name / "fp32.pt", weights_only=False)["param"]
        assert bits_equal(got[name], fp32.reshape(got[name].shape)), name
