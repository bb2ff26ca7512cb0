"""#40: an AutoTP checkpoint saved at ZeRO stage 0 written for an AutoTP stage-0 job (``reshard [--stage 0]``,
export/reshard_tensor_stage0.py): at its tensor degree for another data-parallel size (tp2 x dp1 -> tp2 x dp2: each
tensor rank's file as saved, ``dp_world_size`` the target's, as export/reshard_stage0_world.py writes a dense one),
merged (``--tensor-parallel 1``: tp1 x dp2) and split (``--tensor-parallel 4``: tp4 x dp1), both by the stage-0 writer
(export/reshard_stage0.py) from the whole model; each with buffers, and with frozen parameters (a weight AutoTP splits,
a bias it leaves whole: merged or split into the module, out of the optimizer).

Ground truth: a real DeepSpeed stage-0 job of the target layout (``DEGREE_RESHARDS``, tests/_harness/optim_job.py)
loads the output with ``engine.load_checkpoint`` and records the Adam moments and step its FP16_UnfusedOptimizer then
holds, its param groups, its loss scale, the buffers and the logits of a fixed batch; the source's own "+optim" job
(tp2 x dp1) recorded the same after loading the source. DeepSpeed's getters answer None at stage 0, so the masters
are the written files' ``fp32_groups`` (what ``FP16_UnfusedOptimizer.load_state_dict`` copies into the job), compared
with the ones the saving job held when it saved (its oracle). Each side's tensor shards are put together by
``parallel_oracles.merged``, by the whole shapes the source job recorded. One more step: test_reshard_one_more_step.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import (
    assert_same,
    bits_equal,
    check_same_to_ckptspec,
    info,
    logits_of,
    merged,
    optim_records,
    rank_oracles,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.checkpoint.embedded import CLIENT_STATE_KEY
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

MOVES = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source)["stage"] == 0 and source_spec(source).get("tp", 1) > 1 and reshard_target(n)[2]["stage"] == 0
)
SOURCE = "tp2-s0-bf16-ws2-buffers"
SAME_DEGREE = "tp2-s0-bf16-ws2-buffers>ws4"  # no --stage: the source's own
FROZEN_SOURCE = "tp2-s0-bf16-ws2-frozen"  # a frozen weight AutoTP splits, a frozen bias it leaves whole
FROZEN = f"{FROZEN_SOURCE}>ws4"
AT_ITS_DEGREE = (SAME_DEGREE, FROZEN)
KEYS = ("exp_avg", "exp_avg_sq")


def _with_tp(records: list[dict]) -> list[dict]:
    """A job without tensor parallelism records no tensor coordinate: its rank holds tensor rank 0's (the whole)."""
    return [{**r, "coords": {**r["coords"], "tp": r["coords"].get("tp", 0)}} for r in records]


def _shapes(ds, source: str) -> dict[str, tuple[int, ...]]:
    """The whole shape of every parameter (frozen ones too) the source job recorded."""
    return {n: tuple(shape) for n, shape in info(ds.path(source))["global_shapes"].items()}


def _model_states(path, mp_rank: int) -> dict:
    tag = (path / "latest").read_text().strip()
    return torch.load(path / tag / f"mp_rank_{mp_rank:02d}_model_states.pt", map_location="cpu", weights_only=False)


def _file_masters(states: dict, trained: set[str]) -> dict[str, torch.Tensor]:
    """A written file's fp32 masters by name: ``fp32_groups`` take the module's ``trained`` parameters in order
    (buffers and frozen parameters left out: DeepSpeed's optimizer order)."""
    names = [n for n in states["module"] if n in trained]
    flat = [m for group in states["optimizer"]["fp32_groups"] for m in group]
    assert len(flat) == len(names)
    return dict(zip(names, flat))


def test_the_moves_are_registered():
    """The same tensor degree at another data-parallel size, merged, split: with buffers, and with frozen
    parameters."""
    other = [f"{s}>tp{t}-s0" for s in (SOURCE, FROZEN_SOURCE) for t in (1, 4)]
    assert MOVES == sorted([*AT_ITS_DEGREE, *other])
    assert all(DEGREE_RESHARDS[n][1:] == (4, {}, {}) for n in AT_ITS_DEGREE)


@pytest.mark.parametrize("name", MOVES)
def test_a_stage0_job_of_the_target_layout_resumes_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = _with_tp(optim_records(entry)), optim_records(ds.path(optim_name(source)))
    tp = spec.get("tp", 1)
    assert len(target) == world_size and {r["coords"]["tp"] for r in target} == set(range(tp))
    assert {r["coords"]["mp_world_size"] for r in target} == {tp}
    sources = {s for r in [*target, *before] for s in r["source"].values()}
    assert sources == {"FP16_UnfusedOptimizer.fp32_groups"} and not any(r["master"] for r in target)
    shapes = _shapes(ds, source)
    # what the saving job held when it saved: its trained parameters' masters (not the frozen ones)
    expected = merged(rank_oracles(ds.path(source)), lambda o: o["masters"], shapes)
    assert expected and (expected.keys() < shapes.keys()) == (source == FROZEN_SOURCE)
    for key in KEYS:
        pick = lambda r, key=key: {n: s[key] for n, s in r["state"].items()}  # noqa: E731
        held, loaded = merged(target, pick, shapes), merged(before, pick, shapes)
        assert held.keys() == loaded.keys() == expected.keys()
        for n, value in loaded.items():
            assert bits_equal(held[n], value), (n, key)
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1 and steps != {0}, steps
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    assert all(r["loss_scaler"] == before[0]["loss_scaler"] for r in target) and before[0]["loss_scaler"]
    # the masters the job copied from the files, against what the saving job held when it saved
    files = [_model_states(entry / "resharded", t) for t in range(tp)]
    written = [{"coords": {"tp": t}, "m": _file_masters(f, set(expected))} for t, f in enumerate(files)]
    masters = merged(written, lambda r: r["m"], shapes)
    assert masters.keys() == expected.keys()
    for n, master in masters.items():
        assert bits_equal(master, expected[n]), n


@pytest.mark.parametrize("name", MOVES)
def test_buffers_frozen_parameters_and_logits_carry_over(name, ds):
    """Every rank's buffers and frozen parameters as loaded (the job filled them with other values first) are the
    source's (each tensor rank's file held its own copy, or shard; merged or split, the frozen weight's shards are
    the target degree's, put together whole by the source job's shapes). The logits of a fixed batch: bit for bit at
    the source's tensor degree, else within one bf16 epsilon per tensor rank of the larger degree at the largest logit
    (the row-parallel partial sums added in another order)."""
    source, _, spec = reshard_target(name)
    target, before = _with_tp(optim_records(ds.path(name))), optim_records(ds.path(optim_name(source)))
    tp, frozen = spec.get("tp", 1), source == FROZEN_SOURCE
    if tp == source_spec(source)["tp"]:  # every tensor rank's own, shards too
        per_rank = [{(r["coords"]["tp"], n): t for n, t in r["module"].items()} for r in (*target, *before)]
        module, expected = union_of(per_rank[: len(target)]), union_of(per_rank[len(target) :])
    elif frozen:  # the frozen weight split at the target's degree: each side's shards put together
        shapes = _shapes(ds, source)
        assert {tuple(r["module"]["blocks.0.up.weight"].shape) for r in target} == {(32 // tp, 16)}
        module, expected = (merged(records, lambda r: r["module"], shapes) for records in (target, before))
    else:  # the buffers, whole on every rank
        module, expected = union_of([r["module"] for r in target]), union_of([r["module"] for r in before])
    kept = {"blocks.0.up.weight", "head.bias"} if frozen else {"running", "step_count"}
    assert {k[1] if isinstance(k, tuple) else k for k in module} == kept and module.keys() == expected.keys()
    for n, t in module.items():
        assert bits_equal(t, expected[n]), n
    logits, reference = logits_of(target), logits_of(before)
    assert logits.abs().max() > 0 and logits.shape == reference.shape
    if tp == source_spec(source)["tp"]:
        assert bits_equal(logits, reference)
    else:
        bound = max(tp, 2) * torch.finfo(torch.bfloat16).eps * reference.abs().max().item()
        assert (logits - reference).abs().max().item() <= bound, (logits - reference).abs().max()


@pytest.mark.parametrize(("name", "mp_rank"), [(n, r) for n in AT_ITS_DEGREE for r in (0, 1)])
def test_at_its_tensor_degree_each_file_is_the_sources_with_the_target_world_size(name, mp_rank, ds):
    """Every entry of the tensor rank's model states, in its order and bit for bit, ``dp_world_size`` the target's
    data-parallel size (2); the source's embedded manifest dropped."""
    out = ds.path(name) / "resharded"
    tag = (out / "latest").read_text().strip()
    assert sorted(p.name for p in (out / tag).iterdir()) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    ours, theirs = _model_states(out, mp_rank), _model_states(ds.path(reshard_target(name)[0]), mp_rank)
    assert (theirs["dp_world_size"], ours["dp_world_size"]) == (1, 2)
    assert list(ours) == [k for k in theirs if k != CLIENT_STATE_KEY]
    for key in ours:
        if key != "dp_world_size":
            assert_same(ours[key], theirs[key], key)


@pytest.mark.parametrize("name", MOVES)
def test_the_output_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a stage-0 checkpoint index of the target's degrees; the same whole model and optimizer
    state (a stage-0 checkpoint's optimizer metadata records no loss scaler: the job's is compared above)."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert before.kind == after.kind == Kind.STAGE0
    tp = spec.get("tp", 1)
    degrees = after.index.topology.degrees
    assert (degrees.data, degrees.tensor, degrees.pipeline) == (world_size // tp, tp, 1)
    check_same_to_ckptspec(before, after, optimizer_keys=("class", "groups"))


def test_the_stage_left_out_is_the_sources_own(ds, tmp_path):
    """Without ``--stage`` the AutoTP stage-0 source stays at stage 0 (the CLI's default: the checkpoint's stage): the
    same bytes as ``--stage 0``."""
    out = tmp_path / "given"
    result = CliRunner().invoke(cli, ["reshard", str(ds.path(SOURCE)), str(out), "--world-size", "4", "--stage", "0"])
    assert result.exit_code == 0 and "(ZeRO stage 0)" in result.output, result.output
    left_out = ds.path(SAME_DEGREE) / "resharded"
    files = [sorted(p.relative_to(d) for d in [root] for p in root.rglob("*.pt")) for root in (out, left_out)]
    assert files[0] == files[1] and len(files[0]) == 2
    assert all((out / f).read_bytes() == (left_out / f).read_bytes() for f in files[0])


def test_the_frozen_source_is_described_as_the_job_held_it(ds):
    """The stage-0 job's fp32_groups hold 8 masters for the 10 parameters its module lists: named by their shapes in
    module order (one choice only: layout/stage0_names.frozen_apart), the other two frozen, placed by the affine_map
    (index extras: the weight split along axis 0, the bias replicated). Read whole, the masters are the ones the job
    held when it saved (its oracle) and every weight, frozen ones too, the one DeepSpeed's job gathered
    (``consolidated.pt``), bit for bit."""
    entry = ds.path("tp2-s0-bf16-ws2-frozen")
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    extras = {e.name: (e.role, [s.placement for s in e.shards]) for e in opened.index.extras}
    assert extras.keys() == {"blocks.0.up.weight", "head.bias"}
    assert extras["head.bias"] == ("frozen", ["replicated", "replicated"])
    role, splits = extras["blocks.0.up.weight"]
    assert role == "frozen" and [(p.split.axis, p.split.offset) for p in splits] == [(0, 0), (0, 16)]
    shapes = _shapes(ds, "tp2-s0-bf16-ws2-frozen")
    masters = merged(rank_oracles(entry), lambda o: o["masters"], shapes)
    read = opened.state_dict()  # fp32 (a frozen bf16 weight: exactly its value)
    assert read.keys() == shapes.keys() and masters.keys() == shapes.keys() - extras.keys()
    for n, master in masters.items():
        assert bits_equal(read[n], master), n
    gathered = torch.load(entry / "consolidated.pt", weights_only=True)
    assert gathered.keys() == shapes.keys()
    for n, weight in gathered.items():
        assert bits_equal(read[n].to(weight.dtype), weight), n


@pytest.mark.parametrize("tp", [1, 4])
def test_frozen_parameters_a_stage0_file_could_not_tell_apart_are_still_refused(tp, ds, tmp_path, monkeypatch):
    """Merged or split, each written file's masters are named by their shapes in module order
    (layout/stage0_names.frozen_apart): the writer checks that this names the trainable parameters alone
    (``reshard_stage0.refuse_untold_frozen``) before anything is written, and refuses by name (CK410) where it would
    not (here made so: no choice named)."""
    monkeypatch.setattr("ckptspec.export.reshard_stage0.named_by_shapes", lambda held, dense: None)
    out = tmp_path / "out"
    args = ["--tensor-parallel", str(tp), "--world-size", str(max(tp, 2)), "--stage", "0"]
    result = CliRunner().invoke(cli, ["reshard", str(ds.path(FROZEN_SOURCE)), str(out), *args])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "CK410" in result.output and "frozen parameters (blocks.0.up.weight, head.bias)" in result.output
    assert "could not tell from the trainable ones" in result.output
    assert not out.exists() or not any(out.iterdir())
