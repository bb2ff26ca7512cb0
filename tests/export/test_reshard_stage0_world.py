"""#40: a data-parallel ZeRO stage-0 checkpoint for a stage-0 job of another world size (``reshard --stage 0``,
export/reshard_stage0_world.py; DeepSpeed issue #2031, "Reshape ZeroStage=0 FP16 Checkpoint").

DeepSpeed 0.19.8's stage-0 job loads a stage-0 save of another world size as is: ``engine._load_checkpoint`` reads
``mp_rank_00_model_states.pt`` whatever ``dp_world_size`` it records, and only ZeRO's loader compares it (the
harness's ``resume-stage-0-ws2-to-3`` is that load). So the output is the source's file with ``dp_world_size`` the
target's, which the checkpoint index reads as the data degree.

Ground truth: a real stage-0 job of the same model at 3 ranks (``DEGREE_RESHARDS``, tests/_harness/optim_job.py)
loads the output with ``engine.load_checkpoint`` and records the Adam moments and step its optimizer then holds (the
client torch Adam's in fp32, else the torch Adam that FP16_UnfusedOptimizer or FP16_Optimizer wraps), its param
groups, its loss scaler (fp16: the dynamic scale and its counters), buffers and the logits of a fixed batch. The
source's "+optim" job (2 ranks) recorded the same after loading the source: every value equal, bit for bit.
DeepSpeed's getters answer None at stage 0, so the masters are read from the output by ckptspec and compared with
the ones the saving job held (its oracle); in fp32 they are the module, whose logits are compared too.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import (
    bits_equal,
    check_same_to_ckptspec,
    logits_of,
    optim_records,
    rank_oracles,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, REGISTRY, RESUME_CASES, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.checkpoint.embedded import CLIENT_STATE_KEY
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

CASES = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source)["stage"] == 0
    and reshard_target(n)[2]["stage"] == 0
    and not any(source_spec(source).get(axis, 1) > 1 for axis in ("tp", "pp", "ep"))
)
KEYS = ("exp_avg", "exp_avg_sq")
SOURCE_RANKS = 2  # every stage-0 source's ("s0-*-ws2")
# What holds the masters a stage-0 job's moments are keyed by (optim_job.py's record "source"), per wrapper
HELD_BY = {
    ("fp32", "torch"): "module (fp32, no masters)",
    ("bf16", "torch"): "FP16_UnfusedOptimizer.fp32_groups",
    ("fp16", "torch"): "FP16_UnfusedOptimizer.fp32_groups",
    ("bf16", "fused"): "FP16_Optimizer.fp32_groups_flat",
    ("fp16", "fused"): "FP16_Optimizer.fp32_groups_flat",
}


def _wrapper(source: str) -> tuple[str, str]:
    spec = source_spec(source)
    return spec["dtype"], spec.get("optimizer", "torch")


def _model_states(path) -> dict:
    tag = (path / "latest").read_text().strip()
    return torch.load(path / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


def test_every_stage0_optimizer_wrapper_is_a_case():
    """fp32 (the client torch Adam), bf16 and fp16 with it (FP16_UnfusedOptimizer), bf16 and fp16 with DeepSpeed's
    FusedAdam (FP16_Optimizer), each from 2 ranks to another number."""
    assert sorted(_wrapper(DEGREE_RESHARDS[n][0]) for n in CASES) == sorted(HELD_BY)
    assert all(reshard_target(n)[1] != SOURCE_RANKS for n in CASES)


def test_deepspeed_loads_a_stage0_save_of_another_world_size_as_is(ds):
    """What this writer rests on: a stage-0 bf16 job of 3 ranks loads DeepSpeed's own 2-rank stage-0 save with
    ``engine.load_checkpoint`` and holds the saving job's fp32 masters (job/resume.py's check)."""
    source, changes, world_size, change = RESUME_CASES["resume-stage-0-ws2-to-3"]
    assert (REGISTRY[source].world_size, world_size, changes, change) == (SOURCE_RANKS, 3, {}, {})
    assert REGISTRY[source].args["stage"] == 0
    outcome = ds.read_json("resume-stage-0-ws2-to-3", "resume.json")
    assert outcome["loaded"] and outcome["consistent"] and outcome["error"] is None, outcome


@pytest.mark.parametrize("name", CASES)
def test_a_stage0_job_of_another_world_size_resumes_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and len(before) == SOURCE_RANKS
    assert {s for r in [*target, *before] for s in r["source"].values()} == {HELD_BY[_wrapper(source)]}
    for key in KEYS:
        held = union_of([{n: v[key] for n, v in r["state"].items()} for r in target])
        expected = union_of([{n: v[key] for n, v in r["state"].items()} for r in before])
        assert held.keys() == expected.keys() and held
        for n, value in expected.items():
            assert bits_equal(held[n], value), (n, key)
    steps = {s for r in target for s in r["step"].values()}
    assert steps == {s for r in before for s in r["step"].values()} and len(steps) == 1 and steps != {0}
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    assert all(r["loss_scaler"] == before[0]["loss_scaler"] for r in target)
    if spec["dtype"] == "fp16":  # the dynamic scale's counters, not only its scale
        assert {"cur_scale", "cur_iter", "last_overflow_iter"} <= set(before[0]["loss_scaler"]), before[0]
    module, expected_module = union_of([r["module"] for r in target]), union_of([r["module"] for r in before])
    assert module.keys() == expected_module.keys() and bool(module) == bool(spec.get("buffers"))
    for n, t in module.items():
        assert bits_equal(t, expected_module[n]), n
    logits = logits_of(target)
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", CASES)
def test_the_file_is_the_source_with_the_target_world_size(name, ds):
    """Every entry of the source's model states, in its order and bit for bit (tensors, their dtypes, shapes and
    strides, the optimizer wrapper's scalars), ``dp_world_size`` the target's; one file, as a stage-0 job saves."""
    source, world_size, _ = reshard_target(name)
    out = ds.path(name) / "resharded"
    tag = (out / "latest").read_text().strip()
    assert [p.name for p in (out / tag).iterdir()] == ["mp_rank_00_model_states.pt"]
    ours, theirs = _model_states(out), _model_states(ds.path(source))
    assert (theirs["dp_world_size"], ours["dp_world_size"]) == (SOURCE_RANKS, world_size)
    assert list(ours) == [k for k in theirs if k != CLIENT_STATE_KEY]
    _assert_same(
        {k: v for k, v in ours.items() if k != "dp_world_size"},
        {k: v for k, v in theirs.items() if k not in ("dp_world_size", CLIENT_STATE_KEY)},
        "",
    )


def _assert_same(ours, theirs, where: str) -> None:
    assert type(ours) is type(theirs), where
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.stride()) == (theirs.dtype, theirs.shape, theirs.stride()), where
        assert bits_equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key, value in theirs.items():
            _assert_same(ours[key], value, f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{where}/{i}")
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", CASES)
def test_the_output_is_described_at_the_target_world_size(name, ds):
    """Valid from its files, a stage-0 checkpoint index of the target's data degree; the same whole model and
    optimizer state; its masters the ones the saving job held when it saved (its oracle), bit for bit."""
    source, world_size, _ = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == before.kind == Kind.STAGE0
    degrees = after.index.topology.degrees
    assert (degrees.data, degrees.tensor, degrees.pipeline) == (world_size, 1, 1)
    assert before.index.topology.degrees.data == SOURCE_RANKS
    check_same_to_ckptspec(before, after)
    masters = union_of([oracle["masters"] for oracle in rank_oracles(ds.path(source))])
    read, buffers = after.state_dict(), set(_model_states(out)["buffer_names"])
    assert read.keys() - masters.keys() == buffers and masters  # besides the masters, the buffers (compared above)
    for n, master in masters.items():
        assert bits_equal(read[n], master), n


def _reshard(args: list, out) -> object:
    return CliRunner().invoke(cli, ["reshard", *map(str, args[:1]), str(out), *map(str, args[1:])])


def test_the_stage_left_out_is_the_sources_own(ds, tmp_path):
    """Without ``--stage`` a stage-0 source stays at stage 0 (the CLI's default: the checkpoint's stage): the same
    bytes as ``--stage 0``."""
    source = ds.path("s0-fp16-ws2")
    for out, stage in ((tmp_path / "left-out", []), (tmp_path / "given", ["--stage", "0"])):
        result = _reshard([source, "--world-size", "3", *stage], out)
        assert result.exit_code == 0 and "(ZeRO stage 0)" in result.output, result.output
    files = [sorted((tmp_path / d).rglob("*.pt")) for d in ("left-out", "given")]
    assert len(files[0]) == len(files[1]) == 1 and files[0][0].read_bytes() == files[1][0].read_bytes()


def test_a_zero3_option_for_a_stage0_target_is_refused_by_name(ds, tmp_path):
    out = tmp_path / "out"
    result = _reshard([ds.path("s0-bf16-ws2"), "--world-size", "3", "--stage", "0", "--sub-group-size", "300"], out)
    assert result.exit_code == 1 and "CK410" in result.output and "--sub-group-size 300" in result.output
    assert not out.exists() or not any(out.iterdir())
