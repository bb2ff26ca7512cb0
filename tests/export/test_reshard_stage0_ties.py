"""#40: a tied ZeRO checkpoint written for a ZeRO stage-0 job (``reshard --stage 0``, export/reshard_stage0.py).

A stage-0 job records no ``shared_params``: its module holds a tie as one tensor under both names (two tensor records
of one storage, offset, shape and strides: what ``module.state_dict()`` gives and torch.save pickles), and its
optimizer holds the tied parameter once (``fp32_groups`` and the torch state: ``module.parameters()`` yields it once).
ckptspec reads such a file's tie from that storage (``layout/stage0_names.stage0_ties``); the writer pickles the tie so.

Ground truth: ZeRO-2 jobs of the model of ``s0-bf16-ws2-tied`` (``head.weight`` is ``emb.weight``, buffers; bf16 and
fp32: ``TIED_ZERO_SPECS``), resharded for stage-0 jobs of 3 ranks that load the output (``ZERO_TIED_TO_STAGE0``,
tests/_harness/reshard_job.py's stage-0 checks), the sources resumed at their own layout taking the same extra step
(the jobs that never stopped), and DeepSpeed's own stage-0 save of the tied model (``s0-bf16-ws2-tied``).
"""

from __future__ import annotations

import zipfile

import pytest
import torch
from _harness.reconstruction import cli, invoke
from _harness.scenarios import SAVED_SPECS, ZERO_TIED_TO_STAGE0

import ckptspec
from ckptspec.deepspeed.kinds import Kind

CASES = sorted(ZERO_TIED_TO_STAGE0)
NATIVE = "s0-bf16-ws2-tied"  # DeepSpeed's own stage-0 save of the same model (bf16)
ZERO_OFF = ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments")
# one more step, 2 -> 3 ranks: stage 0's all-reduce against ZeRO-2's reduce-scatter (test_reshard.py's bounds)
STEP_TOLERANCE = {"bf16": 1e-3, "fp32": 1e-5}


def _dtype(case: str) -> str:
    return SAVED_SPECS[ZERO_TIED_TO_STAGE0[case][0]][0]["dtype"]


def _model_file(out) -> object:
    return out / (out / "latest").read_text().strip() / "mp_rank_00_model_states.pt"


def _states(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _view(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _storages(path) -> int:
    with zipfile.ZipFile(path) as z:
        return sum(1 for n in z.namelist() if "/data/" in n and not n.endswith("/"))


@pytest.mark.parametrize("case", CASES)
def test_a_stage0_job_loads_the_tie_as_one_parameter(case, ds):
    """The stage-0 job at 3 ranks holds, after ``engine.load_checkpoint``, the source job's live masters under both
    names of the tie (FP16_UnfusedOptimizer's fp32_groups; fp32: the module), every Adam moment and the step as the
    source's optimizer held them (read from the stage-0 optimizer itself: DeepSpeed's getters answer None at stage 0),
    five masters for five parameters (the tie once), the tie one parameter holding the source's master in the model
    dtype, the buffers as saved; after one more step the tie is still one parameter, held once, holding its stepped
    master."""
    outcome = ds.read_json(case, "resume.json")
    assert outcome["reshard_error"] is None and outcome["error"] is None and outcome["loaded"], outcome
    assert outcome["consistent"] and outcome["mismatched"] == [], outcome
    assert outcome["optim_consistent"] and outcome["optim_mismatched"] == [], outcome
    assert outcome["masters_held"] == [5, 5, 5], outcome
    assert outcome["tied_checked"] == ["head.weight"] and outcome["tied_mismatched"] == [], outcome
    assert outcome["buffers_checked"] == ["running", "step_count"] and outcome["model_mismatched"] == [], outcome
    assert (outcome["global_steps"], outcome["skipped_steps"]) == (2, 0)
    assert outcome["loss_scale"] == (1.0 if _dtype(case) == "bf16" else None)
    assert outcome["tied_after_step_mismatched"] == [], outcome


@pytest.mark.parametrize("case", CASES)
def test_logits_and_one_more_step_carry_over(case, ds):
    """The logits of a fixed batch equal a plain torch model's holding the source's saved module, bit for bit; one more
    step on the same 12-sample batch moves the masters (the tie's both names) as it moves the source job resumed at its
    own layout, within STEP_TOLERANCE."""
    source = ZERO_TIED_TO_STAGE0[case][0]
    logits = torch.load(ds.path(case) / "logits.pt", weights_only=True)
    assert logits["job"].abs().max() > 0 and torch.equal(logits["job"], logits["source"])
    resumed = torch.load(ds.path(case) / "after_step.pt", weights_only=True)
    never_stopped = torch.load(ds.path(f"native-{source}") / "after_step.pt", weights_only=True)
    before = torch.load(ds.path(source) / "live_fp32.pt", weights_only=True)
    assert resumed.keys() == never_stopped.keys() == before.keys() and "head.weight" in before
    assert torch.equal(resumed["head.weight"], resumed["emb.weight"])
    assert any(not torch.equal(never_stopped[n], before[n].float()) for n in before)  # the step moved them
    worst = max((resumed[n] - never_stopped[n]).abs().max().item() for n in never_stopped)
    assert worst <= STEP_TOLERANCE[_dtype(case)], worst


@pytest.mark.parametrize("case", CASES)
def test_the_file_holds_the_tie_once(case, ds):
    """The written file: ``head.weight`` is ``emb.weight``'s storage, offset, shape and strides (a tensor record of its
    own, as torch.save writes the two views a stage-0 job's state dict gives), one storage fewer than entries; the
    optimizer holds five parameters (bf16: five fp32_groups masters and five torch states), the ZeRO entries None."""
    path = _model_file(ds.path(case) / "resharded")
    ours = _states(path)
    module = ours["module"]
    assert _view(module["head.weight"]) == _view(module["emb.weight"])
    assert module["head.weight"] is not module["emb.weight"]
    assert all(ours[k] is None for k in ZERO_OFF) and ours["ds_config"]["zero_optimization"]["stage"] == 0
    torch_state = ours["optimizer"] if _dtype(case) == "fp32" else ours["optimizer"]["optimizer_state_dict"]
    assert sorted(torch_state["state"]) == [0, 1, 2, 3, 4]
    assert [g["params"] for g in torch_state["param_groups"]] == [[0, 1, 2, 3, 4]]
    masters = 0 if _dtype(case) == "fp32" else sum(len(g) for g in ours["optimizer"]["fp32_groups"])
    assert _storages(path) == len(module) - 1 + masters + 3 * 5  # each state: step, exp_avg, exp_avg_sq


def test_the_file_is_deepspeeds_own_stage0_tied_save_key_for_key(ds):
    """Against DeepSpeed's own stage-0 save of the same model (``s0-bf16-ws2-tied``, another run): the same keys, module
    entries (the tie the same view in both), dtypes, shapes and strides of every tensor, optimizer entries, torch state
    keys per parameter, param groups, fp32_groups shapes, and the same number of storages."""
    case = next(c for c in CASES if _dtype(c) == "bf16")
    path = _model_file(ds.path(case) / "resharded")
    native_path = _model_file(ds.path(NATIVE))
    ours, theirs = _states(path), _states(native_path)
    assert list(ours) == list(theirs) and list(ours["module"]) == list(theirs["module"])
    for states in (ours, theirs):
        assert _view(states["module"]["head.weight"]) == _view(states["module"]["emb.weight"])
    for name, t in ours["module"].items():
        other = theirs["module"][name]
        assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (
            other.dtype,
            other.shape,
            other.stride(),
            other.storage_offset(),
        ), name
    assert list(ours["optimizer"]) == list(theirs["optimizer"])
    inner, native_inner = ours["optimizer"]["optimizer_state_dict"], theirs["optimizer"]["optimizer_state_dict"]
    assert inner["param_groups"] == native_inner["param_groups"]
    for (i, state), (j, native_state) in zip(inner["state"].items(), native_inner["state"].items(), strict=True):
        assert i == j and list(state) == list(native_state)
        assert all((v.dtype, v.shape) == (native_state[k].dtype, native_state[k].shape) for k, v in state.items())
    shapes = [[(m.dtype, m.shape) for m in g] for g in ours["optimizer"]["fp32_groups"]]
    assert shapes == [[(m.dtype, m.shape) for m in g] for g in theirs["optimizer"]["fp32_groups"]]
    assert _storages(path) == _storages(native_path)


def test_a_zero3_tie_is_written_as_the_zero2_one(ds, tmp_path):
    """From ZeRO-3 (whose module holds placeholders: the tie's weight is its master cast): the bf16 ZeRO-2 source
    written as ZeRO-3, then for a stage-0 job, is the file written from ZeRO-2 directly, entry for entry and bit for
    bit (the module's weights are the masters cast, as the ZeRO-2 job's), but for the ``sub_group_size`` the ZeRO-3
    config records; the tie one storage under both names."""
    case = next(c for c in CASES if _dtype(c) == "bf16")
    source = ds.path(ZERO_TIED_TO_STAGE0[case][0])
    cli("reshard", source, tmp_path / "s3", "--world-size", "2", "--stage", "3")
    cli("reshard", tmp_path / "s3", tmp_path / "s0", "--world-size", "3", "--stage", "0")
    ours, direct = _states(_model_file(tmp_path / "s0")), _states(_model_file(ds.path(case) / "resharded"))
    del ours["ds_config"]["zero_optimization"]["sub_group_size"]
    _same(ours, direct, [])
    assert _view(ours["module"]["head.weight"]) == _view(ours["module"]["emb.weight"])


def _same(a, b, where: list) -> None:
    """``a`` is ``b``: the same entries in order, every tensor's dtype, shape, strides, offset and bits."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b), where
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _same(a[key], b[key], [*where, key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, [*where, i])
    else:
        assert a == b, where


def test_deepspeeds_tied_stage0_save_comes_back_bit_for_bit(ds, tmp_path):
    """DeepSpeed's own stage-0 tied save written as ZeRO-2 (3 ranks), then back for a stage-0 job of 2 ranks: every
    entry and tensor of its file again, bit for bit, with the same strides and offsets, the tie one storage under both
    names (no DeepSpeed job: the ZeRO-2 job loading the first output is test_stage0_ties.py's)."""
    source = ds.path(NATIVE)
    cli("reshard", source, tmp_path / "s2", "--world-size", "3", "--stage", "2")
    cli("reshard", tmp_path / "s2", tmp_path / "s0", "--world-size", "2", "--stage", "0")
    ours, theirs = _states(_model_file(tmp_path / "s0")), _states(_model_file(source))

    _same(ours, theirs, [])
    module = ours["module"]
    assert _view(module["head.weight"]) == _view(module["emb.weight"])


@pytest.mark.parametrize("case", CASES)
def test_ckptspec_reads_the_output_as_the_tied_source(case, ds, tmp_path):
    """Valid from its files (a stage-0 checkpoint index), the tie read as a tie (not a frozen parameter), the same
    whole model and optimizer state as the source's; ``reconstruct`` stores the tie once and gives both names the
    source job's live master."""
    from _harness.parallel_oracles import check_same_to_ckptspec

    from ckptspec.export.api import load_consolidated

    source, out = ZERO_TIED_TO_STAGE0[case][0], ds.path(case) / "resharded"
    result = invoke("validate", out)
    assert result.exit_code == 0, result.output
    opened = ckptspec.open(out)
    (domain,) = opened.domains
    assert opened.kind == Kind.STAGE0
    assert [(a.name, a.owner, a.shape) for a in domain.manifest.aliases] == [("head.weight", "emb.weight", [50, 16])]
    assert domain.manifest.frozen == []
    check_same_to_ckptspec(ckptspec.open(ds.path(source)), opened, optimizer_keys=("class", "groups"))
    cli("reconstruct", out, tmp_path / "whole", "--quiet")
    whole = load_consolidated(tmp_path / "whole")
    live = torch.load(ds.path(source) / "live_fp32.pt", weights_only=True)
    for name, master in live.items():
        assert torch.equal(whole[name], master), name
