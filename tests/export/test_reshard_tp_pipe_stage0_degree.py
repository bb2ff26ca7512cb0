"""#40: a tensor x pipeline checkpoint (job/tp_layers.py's Megatron-style PipelineModule) at another tensor degree and
another ZeRO stage in one command (scenarios.TP_PIPE_STAGE0_DEGREES; reshard_pipeline_stage0.plan_restaged): the
stage-0 sources merged for a tp1 x pp2 stage-0 job (written as ZeRO-1, merged, written at stage 0) and for a ZeRO-1 one
(written as ZeRO-1, merged), DeepSpeed's tp2 x pp2 ZeRO-1 save merged for a stage-0 job (merged, written at stage 0),
and the stage-0 sources split to tp4 at one stage for a tp4 x pp1 stage-0 job (written as ZeRO-1, split, moved,
written at stage 0).

Ground truth: a real job of the target layout loads the output (optim_job.py; a bf16 stage-0 one as DeepSpeed's own
save loads: load_checkpoint fails with KeyError: 0, then its ZeRO-file reader) and holds, put together whole over its
tensor ranks, the masters and Adam moments the saving job gathered whole over its tensor groups (its oracle), bit for
bit, at its step, with the param groups the source job resumed at its own layout holds (its "+optim" entry). The
logits of the fixed batch and one more step on the same batch are the "+optim" entry's within STEP_BOUNDS: another
tensor degree sums each row-parallel block's output in another order (tests/export/test_reshard_tp_pipe_step.py says
how far that moves a step). The output is, file for file and byte for byte, what the separate commands of the chain
write in turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import (
    assert_refused_while_planning,
    bits_equal,
    gathered_whole,
    logits_of,
    merged,
    optim_records,
)
from _harness.reconstruction import invoke
from _harness.scenarios import TP_PIPE_STAGE0_DEGREES, optim_name, reshard_target, source_spec

import ckptspec

CASES = sorted(TP_PIPE_STAGE0_DEGREES)
KEYS = ("master", "exp_avg", "exp_avg_sq")
STAGE_LAYERS = {1: [[0, 5]], 2: [[0, 3], [3, 5]]}  # the five layers' stages (partition "parameters")
# How far the target may leave the source resumed at its own layout ("+optim"), by dtype: "logits", the fixed batch's
# logits (after loading, and after the step) as a share of the largest logit; "norm", each tensor's whole difference
# after the step (masters where both jobs' getters give them, moments) as a share of the norm of the step's movement
# of it in the source. Another tensor degree only: a row-parallel block sums T partial products (the merged one all H
# in one matmul), which moves the step by a few ulps (tests/export/test_reshard_tp_pipe_step.py's bounds). Measured
# (docs/reshard.md): fp32 at most 2.6e-7 of a step's norm, logits 1.6e-7; bf16 at most 1.9% of a step's norm (a
# master; moments 1.5%), logits 0.47% after loading and 1.08% after the step (tp2 x pp2 stage 0 -> tp1 x pp2 stage 0:
# two bf16 ulps at the largest logit 0.36, where one is 2^-9, 0.54%), bounded by three ulps.
STEP_BOUNDS = {"fp32": {"logits": 1e-6, "norm": 1e-4}, "bf16": {"logits": 0.017, "norm": 0.05}}


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _layer_file(layer: int, tensor: int, tp: int) -> str:
    return f"layer_{layer:02d}-model_states.pt" if tp == 1 else f"layer_{layer:02d}-model_{tensor:02d}-model_states.pt"


def _state(records: list[dict]) -> list[dict]:
    """Each record's coordinates, and its masters (DeepSpeed's getter's) and moments by global name."""
    out = []
    for r in records:
        moments = {k: {n: s[k] for n, s in r["state"].items()} for k in ("exp_avg", "exp_avg_sq")}
        out.append({"coords": r["coords"], "master": dict(r["master"]), **moments})
    return out


def _held(ds, name: str, records: list[dict]) -> list[dict]:
    """``_state``, the masters of an fp32 stage-0 job (none from the getter: it trains the module itself) the weights
    of the layer files it loaded, as written."""
    spec = reshard_target(name)[2]
    out = _state(records)
    if spec["stage"] == 0 and spec["dtype"] == "fp32":
        tag = tag_dir(ds.path(name) / "resharded")
        for held, r in zip(out, records):
            for n in r["state"]:
                layer, key = n.split(".", 1)
                held["master"][n] = _load(tag / _layer_file(int(layer), r["coords"]["tp"], spec["tp"]))[key]
    return out


def _whole(held: list[dict], shapes: dict) -> dict:
    """key -> global name -> the whole tensor the target's tensor ranks hold together."""
    return {key: merged(held, lambda r, key=key: r[key], shapes) for key in KEYS}


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_the_sources_whole_masters_moments_and_step(ds, name):
    source, world_size, spec = reshard_target(name)
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    bf16_stage0 = spec["dtype"] == "bf16" and spec["stage"] == 0
    assert outcome.get("reshard_error") is None, outcome
    assert outcome["load_checkpoint_error"] == ("KeyError: 0" if bf16_stage0 else None), outcome  # DeepSpeed's own
    records = optim_records(ds.path(name))
    stages, tp = spec["pp"], spec["tp"]
    per_stage = world_size // stages  # the grid's ranks: pipeline-major, then data, then tensor
    coords = [(r["coords"]["pp"], r["coords"]["tp"]) for r in records]
    assert coords == [(rank // per_stage, rank % tp) for rank in range(world_size)]
    if tp > 1:  # tp_layers' records say which layers each stage runs
        layers = [r["coords"]["stage_layers"] for r in records]
        assert layers == [STAGE_LAYERS[stages][rank // per_stage] for rank in range(world_size)]
    masters = gathered_whole(ds.path(source))["master"]  # what the saving job gathered over its tensor groups
    shapes = {n: tuple(v.shape) for n, v in masters.items()}
    before = optim_records(ds.path(optim_name(source)))
    # the moments the source job resumed at its own layout holds (an fp32 stage-0 job gathers none when it saves)
    expected = {**_whole(_state(before), shapes), "master": masters}
    held = _whole(_held(ds, name, records), shapes)
    for key in KEYS:
        assert sorted(held[key]) == sorted(expected[key]) == sorted(shapes), key
        for n, value in expected[key].items():
            assert bits_equal(held[key][n], value), (key, n)
    assert {s for r in records for s in r["step"].values()} == {2.0}  # the source trained two steps
    assert all(r["param_groups"] == before[0]["param_groups"] for r in records)
    bound = STEP_BOUNDS[spec["dtype"]]["logits"]
    logits, expected = logits_of(records).float(), logits_of(before).float()
    assert logits.abs().max() > 0 and (logits - expected).abs().max() <= bound * expected.abs().max()


@pytest.mark.parametrize("name", CASES)
def test_one_more_step_moves_the_target_as_it_moves_the_source(ds, name):
    """The step the source resumed at its own layout takes (its "+optim" entry), at the target's tensor degree: the
    same step count, each tensor's masters (where both jobs' getters give them) and moments within STEP_BOUNDS of the
    step's own movement, the logits after it within their bound."""
    source, _, spec = reshard_target(name)
    whole = gathered_whole(ds.path(source))
    shapes = {n: tuple(v.shape) for n, v in whole["master"].items()}
    reference = ds.path(optim_name(source))
    ref_before = _whole(_state(optim_records(reference)), shapes)
    ref_after = _whole(_state(optim_records(reference, "step")), shapes)
    target_records = optim_records(ds.path(name), "step")
    after = _whole(_state(target_records), shapes)
    assert {s for r in target_records for s in r["step"].values()} == {3.0}
    assert {s for r in optim_records(reference, "step") for s in r["step"].values()} == {3.0}
    bound = STEP_BOUNDS[spec["dtype"]]
    compared = 0
    for key in KEYS:
        for n, value in ref_after[key].items():
            if n not in after[key]:  # a master no getter gives (an fp32 stage-0 job's)
                continue
            moved = (value - ref_before[key][n]).norm()
            assert moved > 0, (key, n)
            off = (after[key][n] - value).norm()
            assert off <= bound["norm"] * moved, (key, n, (off / moved).item())
            compared += 1
    assert compared >= 2 * len(shapes)  # the moments of every tensor at least
    logits, expected = logits_of(target_records).float(), logits_of(optim_records(reference, "step")).float()
    assert not torch.equal(expected, logits_of(optim_records(reference)).float())  # the step moved them
    assert (logits - expected).abs().max() <= bound["logits"] * expected.abs().max()


def _commands(name: str) -> list[list[str]]:
    """The separate commands the one command chains (docs/reshard.md): a stage-0 source written as ZeRO-1 at its own
    layout, that merged or split (and moved), the result written at stage 0."""
    source, world_size, spec = reshard_target(name)
    options = TP_PIPE_STAGE0_DEGREES[name][3]
    out = []
    if source_spec(source)["stage"] == 0:
        out.append(["--world-size", "4", "--stage", "1"])
    move = ["--tensor-parallel", str(options["tensor_parallel"]), "--world-size", str(world_size)]
    if "pipeline_parallel" in options:
        move += ["--pipeline-parallel", str(options["pipeline_parallel"])]
    out.append(move)
    if spec["stage"] == 0:
        out.append(["--world-size", str(world_size), "--stage", "0"])
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", CASES)
def test_the_output_is_what_the_separate_commands_write_file_for_file(ds, name, tmp_path):
    source = ds.path(reshard_target(name)[0])
    for step, args in enumerate(_commands(name)):
        result = invoke("reshard", source, tmp_path / f"step{step}", *args)
        assert result.exit_code == 0, (args, result.output)
        source = tmp_path / f"step{step}"
    ours, theirs = _files(ds.path(name) / "resharded"), _files(source)
    assert sorted(ours) == sorted(theirs) and len(ours) > 4
    assert [f for f in ours if ours[f] != theirs[f]] == []


def test_the_command_writes_what_the_job_loaded_and_names_the_load(ds, tmp_path):
    """The issue's command line, byte for byte the output the target job loaded; it names the load that resumes a
    bf16 stage-0 pipeline, and leaves no step's directory behind."""
    name = "tp2pp2-s0-bf16-ws4>tp1-s0"
    args = ["--tensor-parallel", "1", "--world-size", "2", "--stage", "0"]
    result = invoke("reshard", ds.path(reshard_target(name)[0]), tmp_path / "out", *args)
    assert result.exit_code == 0, result.output
    assert "load_optimizer_states=False), then engine._load_zero_checkpoint(" in result.output
    ours, loaded = _files(tmp_path / "out"), _files(ds.path(name) / "resharded")
    assert sorted(ours) == sorted(loaded) and all(ours[f] == loaded[f] for f in ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no step's directory left beside it


@pytest.mark.parametrize(
    ("source", "world_size", "options", "refusal"),
    [
        ("tp2pp2-s0-bf16-ws4", 3, {"zero_stage": 0, "tensor_parallel": 1}, "--world-size 3 is not a multiple of the"),
        ("tp2pp2-s0-fp32-ws4", 6, {"tensor_parallel": 3}, "not a multiple of --tensor-parallel 3"),
        ("tp2pp2-s1-bf16-ws4", 6, {"zero_stage": 0, "tensor_parallel": 3}, "not a multiple of --tensor-parallel 3"),
        ("tp2pp2-s0-fp32-ws4", 2, {"zero_stage": 2, "tensor_parallel": 1}, "--stage 2 for a stage-0 pipeline"),
        (
            "tp2pp2-s0-bf16-ws4",
            6,
            {"zero_stage": 0, "tensor_parallel": 1, "pipeline_parallel": 6},
            "5 layers, fewer than the stages",
        ),
        (
            "tp2pp2-s1-fp32-ws4",
            4,
            {"zero_stage": 0, "tensor_parallel": 4, "pipeline_parallel": 1, "partition_method": "type:Linear"},
            "'type:Linear' is not supported",
        ),
        (
            "tp2pp2-s0-fp32-ws4",
            6,
            {"tensor_parallel": 4, "pipeline_parallel": 1},
            "--world-size 6 is not a multiple of --pipeline-parallel 1 x --tensor-parallel 4",
        ),
    ],
)
def test_what_is_not_written_is_refused_before_any_step_runs(
    ds, tmp_path, monkeypatch, source, world_size, options, refusal
):
    """CK410 naming the source while planning: no step of the chain runs, nothing is written."""
    assert_refused_while_planning(ds.path(source), tmp_path / "out", monkeypatch, world_size, options, refusal)


def test_a_step_that_refuses_leaves_nothing_behind(ds, tmp_path, monkeypatch):
    """What only a written step shows (here: the merge refusing, as it would tensor ranks' replicated copies that
    differ) fails the command naming the source; no output is published and no step's directory is left."""
    from ckptspec.errors import ReshardUnsupported
    from ckptspec.export import reshard_parallel

    real, calls = reshard_parallel.reshard_model_parallel, []

    def step(checkpoint, output, world_size, **options):
        calls.append(options)
        if options.get("tensor_parallel") is not None:  # the merge: refused after the first step wrote its output
            raise ReshardUnsupported("the merge refused", "none")
        return real(checkpoint, output, world_size, **options)

    monkeypatch.setattr(reshard_parallel, "reshard_model_parallel", step)
    source = ds.path("tp2pp2-s0-fp32-ws4")
    with pytest.raises(ckptspec.Unsupported) as refused:
        real(source, tmp_path / "out", 2, zero_stage=0, tensor_parallel=1)
    assert refused.value.message == "the merge refused" and refused.value.file == str(source)
    assert [c.get("zero_stage") for c in calls] == [1, 1]  # written as ZeRO-1, then the merge
    assert [p.name for p in tmp_path.iterdir()] == []
