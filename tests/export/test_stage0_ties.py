"""A ZeRO stage-0 checkpoint with a tie (``head.weight`` is ``emb.weight``): DeepSpeed records no ``shared_params`` at
stage 0, its module holds the same tensor under both names and its optimizer holds the tied parameter once, so the
masters are one fewer than the module's parameters. ckptspec tells the tie from a frozen parameter by the pickled
tensor itself (``stage0_names.stage0_ties``: the same storage, offset, shape and strides), where it used to refuse
the checkpoint (CK202).

Ground truth: the real job ``s0-bf16-ws2-tied`` (FP16_UnfusedOptimizer, a tie and buffers; its live fp32 masters
recorded), its reshard to ZeRO-2 at 3 ranks loaded by a real ZeRO-2 job (``reshard-s0-bf16-tied-to-s2-2to3``,
tests/_harness/reshard_job.py), and the source resumed at its own layout taking the same extra step (the job that never
stopped).
"""

from __future__ import annotations

import pytest
import torch
from _harness.reconstruction import cli, invoke
from _harness.scenarios import STAGE0_TIED_RESHARDS

import ckptspec

SOURCE = "s0-bf16-ws2-tied"
CASE = "reshard-s0-bf16-tied-to-s2-2to3"
STEP_TOLERANCE = 1e-3  # bf16, 2 -> 3 ranks, stage 0's all-reduce against ZeRO-2's reduce-scatter (test_reshard.py's)


def _saved_model_states(ds, name: str) -> dict:
    tag = ds.path(name) / "global_step2"
    return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


def test_the_job_saved_one_tensor_under_two_names_and_no_shared_params(ds):
    """The premise: stage 0 records no tie; the module holds ``emb.weight``'s very tensor as ``head.weight``, and the
    optimizer one master fewer than the module's parameters."""
    states = _saved_model_states(ds, SOURCE)
    assert states["shared_params"] is None and states["param_shapes"] is None
    module = states["module"]
    assert module["head.weight"].data_ptr() == module["emb.weight"].data_ptr()
    trainable = [n for n in module if n not in states["buffer_names"]]
    assert sum(len(g) for g in states["optimizer"]["fp32_groups"]) == len(trainable) - 1


def test_the_tie_is_described_as_a_tie_not_as_a_frozen_parameter(ds):
    """Valid; the one domain names ``head.weight`` an alias of ``emb.weight`` (with its shape) and nothing frozen."""
    result = invoke("validate", ds.path(SOURCE))
    assert result.exit_code == 0, result.output
    (domain,) = ckptspec.open(ds.path(SOURCE)).domains
    assert [(a.name, a.owner, a.shape) for a in domain.manifest.aliases] == [("head.weight", "emb.weight", [50, 16])]
    assert domain.manifest.frozen == []
    assert "head.weight" not in {p.name for g in domain.manifest.groups for p in g.params}


def test_it_reconstructs_the_live_masters(ds, tmp_path):
    """Every tensor, the tie's both names included, is the live engine's fp32 master bit for bit (the tie stored
    once), and the buffers the saved ones."""
    from safetensors.torch import load_file

    from ckptspec.export.api import load_consolidated

    cli("reconstruct", ds.path(SOURCE), tmp_path / "out", "--quiet")
    stored, whole = load_file(tmp_path / "out" / "model.safetensors"), load_consolidated(tmp_path / "out")
    live = torch.load(ds.path(SOURCE) / "live_fp32.pt", weights_only=True)
    module = _saved_model_states(ds, SOURCE)["module"]
    assert "head.weight" not in stored and sorted(whole) == sorted(module) and "head.weight" in live
    for name, master in live.items():
        assert whole[name].dtype == torch.float32 and torch.equal(whole[name], master), name
    for name in ("running", "step_count"):
        assert torch.equal(whole[name], module[name]), name


@pytest.mark.parametrize("case", sorted(STAGE0_TIED_RESHARDS))
def test_a_zero_job_loads_the_tied_source_bit_for_bit(case, ds):
    """The ZeRO-2 job at 3 ranks holds the source's live masters under both names of the tie (one parameter), its
    buffers, and the step the source's optimizer saved."""
    outcome = ds.read_json(case, "resume.json")
    assert outcome["reshard_error"] is None and outcome["error"] is None and outcome["loaded"], outcome
    assert outcome["consistent"] and outcome["mismatched"] == [], outcome
    assert outcome["tied_checked"] == ["head.weight"] and outcome["tied_mismatched"] == [], outcome
    assert outcome["buffers_checked"] == ["running", "step_count"] and outcome["model_mismatched"] == [], outcome
    assert outcome["getter_fp32_mismatched"] == [] and outcome["getter_optim_mismatched"] == [], outcome
    assert outcome["global_steps"] == 2 and outcome["skipped_steps"] == 0 and outcome["loss_scale"] == 1.0
    # the source job's live optimizer oracle holds nothing at stage 0: the only difference is its missing steps
    saved_step = float(
        _saved_model_states(ds, STAGE0_TIED_RESHARDS[case][0])["optimizer"]["optimizer_state_dict"]["state"][0]["step"]
    )
    assert outcome["optim_mismatched"] == [f"steps {{0: {saved_step}}} != {{}}"], outcome


@pytest.mark.parametrize("case", sorted(STAGE0_TIED_RESHARDS))
def test_the_output_holds_the_source_optimizers_moments(case, ds, tmp_path):
    """The moments the ZeRO-2 files hold (read back by ``reconstruct --optimizer-state``) are the stage-0 torch
    optimizer's, read with torch: its state is by position in module order, the tie's second name left out."""
    from safetensors.torch import load_file

    source = STAGE0_TIED_RESHARDS[case][0]
    states = _saved_model_states(ds, source)
    names = [n for n in states["module"] if n not in states["buffer_names"] and n != "head.weight"]
    saved = states["optimizer"]["optimizer_state_dict"]["state"]
    cli("reconstruct", ds.path(case) / "resharded", tmp_path / "out", "--optimizer-state", "--quiet")
    written = load_file(tmp_path / "out" / "optimizer.safetensors")
    assert sorted(written) == sorted(f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq"))
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(written[f"{name}.{key}"], saved[i][key].view(states["module"][name].shape)), name


@pytest.mark.parametrize("case", sorted(STAGE0_TIED_RESHARDS))
def test_one_more_step_moves_as_the_job_that_never_stopped(case, ds):
    """The same extra step on the same 12-sample batch, against the source resumed at stage 0 (another reduction and
    other shares per rank: the bf16 bound of test_reshard.py); a wrong moment or step would move a master by ~lr."""
    source = STAGE0_TIED_RESHARDS[case][0]
    resumed = torch.load(ds.path(case) / "after_step.pt", weights_only=True)
    never_stopped = torch.load(ds.path(f"native-{source}") / "after_step.pt", weights_only=True)
    before = torch.load(ds.path(source) / "live_fp32.pt", weights_only=True)
    assert resumed.keys() == never_stopped.keys() == before.keys() and "head.weight" in before
    assert any(not torch.equal(never_stopped[n], before[n].float()) for n in before)  # the step moved them
    worst = max((resumed[n] - never_stopped[n]).abs().max().item() for n in never_stopped)
    assert worst <= STEP_TOLERANCE, worst
