"""#40: a tensor x pipeline checkpoint (job/tp_layers.py's Megatron-style PipelineModule) at another number of stages
and another ZeRO stage in one command (scenarios.TP_PIPE_STAGE0_STAGES; reshard_pipeline_stage0.plan_restaged): a
stage-0 source written for a stage-0 job (``--pipeline-parallel 1 --stage 0``: written as ZeRO-1, moved, written at
stage 0) and for a ZeRO-1 job (``--stage 1``: written as ZeRO-1, moved), and DeepSpeed's tp2 x pp1 ZeRO-1 save written
for a tp2 x pp2 stage-0 job (moved, written at stage 0).

Ground truth: a real job of the target layout loads the output (optim_job.py; a bf16 stage-0 one as DeepSpeed's own
save loads: load_checkpoint fails with KeyError: 0, then its ZeRO-file reader) and holds, for each tensor rank and
global name, the master the saving job held (its oracle), the moments, step and param groups the source job resumed
at its own layout holds (its "+optim" entry), the same logits; after one more step on the same batch the same state
as that resume after it (only the stages moved: the same sums, bit for bit). The files are DeepSpeed's own save at
the target layout where one is made (tp2 x pp1 ZeRO-1, tp2 x pp2 stage 0).
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
    logits_of,
    optim_records,
    rank_oracles,
    saved_entries,
)
from _harness.reconstruction import invoke
from _harness.scenarios import TP_PIPE_STAGE0_STAGES, optim_name, reshard_target, source_spec

CASES = sorted(TP_PIPE_STAGE0_STAGES)
MOMENTS = ("exp_avg", "exp_avg_sq")
STAGE_LAYERS = {1: [[0, 5]], 2: [[0, 3], [3, 5]]}  # the five layers' stages (partition "parameters")
# DeepSpeed's own save at the target's layout (fp32), by (stages, ZeRO stage)
SAVED = {(1, 1): "tp2pp1-s1-fp32-ws2", (2, 0): "tp2pp2-s0-fp32-ws4"}


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _by_tensor_rank(records: list[dict], key: str) -> dict:
    """(tensor rank, global name) -> the records' ``key`` entry; every holder of it the same (its data-parallel copies,
    a tie's stages)."""
    out: dict = {}
    for r in records:
        for name, value in r[key].items():
            held = out.setdefault((r["coords"]["tp"], name), value)
            if isinstance(value, dict):
                assert all(bits_equal(held[k], v) for k, v in value.items()), name
            else:
                assert held == value if isinstance(value, float) else bits_equal(held, value), name
    return out


def _masters_held(ds, name: str, records: list[dict]) -> dict:
    """(tensor rank, global name) -> the target job's master: DeepSpeed's getter, or (an fp32 stage-0 job, none: it
    trains the module itself) the weights of the layer files it loaded, as written."""
    spec = reshard_target(name)[2]
    if spec["stage"] != 0 or spec["dtype"] != "fp32":
        return _by_tensor_rank(records, "master")
    tag = tag_dir(ds.path(name) / "resharded")
    out = {}
    for r in records:
        tp = r["coords"]["tp"]
        for local in r["state"]:
            layer, key = local.split(".", 1)
            out[tp, local] = _load(tag / f"layer_{int(layer):02d}-model_{tp:02d}-model_states.pt")[key]
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_the_sources_masters_moments_step_and_logits(ds, name):
    source, world_size, spec = reshard_target(name)
    stages = spec["pp"]
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    bf16_stage0 = spec["dtype"] == "bf16" and spec["stage"] == 0
    assert outcome.get("reshard_error") is None, outcome
    assert outcome["load_checkpoint_error"] == ("KeyError: 0" if bf16_stage0 else None), outcome  # DeepSpeed's own
    records, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    per_stage = world_size // stages  # the grid's ranks: pipeline-major, then data, then tensor
    assert [(r["coords"]["pp"], r["coords"]["tp"], r["coords"]["stage_layers"]) for r in records] == [
        (rank // per_stage, rank % 2, STAGE_LAYERS[stages][rank // per_stage]) for rank in range(world_size)
    ]
    masters = {}
    for oracle in rank_oracles(ds.path(source)):  # what the saving job held
        masters.update({(oracle["coords"]["tp"], n): m for n, m in oracle["masters"].items()})
    moments, steps = _by_tensor_rank(before, "state"), _by_tensor_rank(before, "step")
    held, state, step = (
        _masters_held(ds, name, records),
        _by_tensor_rank(records, "state"),
        _by_tensor_rank(records, "step"),
    )
    assert sorted(held) == sorted(state) == sorted(masters) == sorted(moments)
    for key, master in masters.items():
        assert bits_equal(held[key], master), key
        assert all(bits_equal(state[key][m], moments[key][m]) for m in MOMENTS), key
        assert step[key] == steps[key] == 2.0, key
    assert all(r["param_groups"] == before[0]["param_groups"] for r in records)
    assert all(all(r["getter"].values()) == (spec["dtype"] == "bf16" or spec["stage"] == 1) for r in records)
    logits = logits_of(records)
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", CASES)
def test_one_more_step_is_the_sources_bit_for_bit(ds, name):
    """The same step the source resumed at its own layout takes: the stages moved only, the same sums."""
    source, _, spec = reshard_target(name)
    after, before = optim_records(ds.path(name), "step"), optim_records(ds.path(optim_name(source)), "step")
    state, expected = _by_tensor_rank(after, "state"), _by_tensor_rank(before, "state")
    assert sorted(state) == sorted(expected)
    for key, moments in expected.items():
        assert all(bits_equal(state[key][m], moments[m]) for m in MOMENTS), key
    assert set(_by_tensor_rank(after, "step").values()) == {3.0}
    masters, theirs = _by_tensor_rank(after, "master"), _by_tensor_rank(before, "master")
    assert all(bits_equal(masters[k], m) for k, m in theirs.items() if k in masters)
    assert len(masters) == (0 if spec["stage"] == 0 and spec["dtype"] == "fp32" else len(state))
    assert bits_equal(logits_of(after), logits_of(before))  # the fixed batch through the stepped weights


@pytest.mark.parametrize("name", CASES)
def test_the_files_are_deepspeeds_at_the_target_layout(ds, name):
    """DeepSpeed's own fp32 save at the target layout where one is made: the file names, every key, tensor dtype and
    shape and every other value (an fp32 stage-0 source saved no clip_grad: none is written, as at its own stages);
    else (bf16 at stage 0 on one stage) the names DeepSpeed gives: BF16_Optimizer's files per tensor rank."""
    source, _, spec = reshard_target(name)
    ours = tag_dir(ds.path(name) / "resharded")
    saved = SAVED.get((spec["pp"], spec["stage"]))
    if saved is None:
        layers = [f"layer_{layer:02d}-model_{tp:02d}-model_states.pt" for layer in range(5) for tp in range(2)]
        optim = [f"bf16_zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt" for mp in range(2)]
        assert sorted(p.name for p in ours.iterdir()) == sorted(
            [*layers, *optim, "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        )
        return
    theirs = tag_dir(ds.path(saved))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    absent = {"/optimizer_state_dict/clip_grad"} if source_spec(source)["stage"] == 0 else set()
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert list(mine) == [k for k in native if k not in absent], file
        assert {k: v for k, v in mine.items() if v != native[k]} == {}, file


def test_the_command_writes_what_the_job_loaded_and_names_the_load(ds, tmp_path):
    """The issue's command line, byte for byte the output the target job loaded; it names the load that resumes a
    bf16 stage-0 pipeline."""
    name = "tp2pp2-s0-bf16-ws4>pp1-s0"
    args = ["--pipeline-parallel", "1", "--world-size", "2", "--stage", "0"]
    result = invoke("reshard", ds.path(reshard_target(name)[0]), tmp_path / "out", *args)
    assert result.exit_code == 0, result.output
    assert "load_optimizer_states=False), then engine._load_zero_checkpoint(" in result.output
    ours, loaded = tag_dir(tmp_path / "out"), tag_dir(ds.path(name) / "resharded")
    files = sorted(p.name for p in loaded.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    assert all((ours / f).read_bytes() == (loaded / f).read_bytes() for f in files)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no step's directory left


@pytest.mark.parametrize(
    ("source", "world_size", "options", "refusal"),
    [
        ("tp2pp2-s0-bf16-ws4", 12, {"zero_stage": 0, "pipeline_parallel": 6}, "5 layers, fewer than the stages"),
        (
            "tp2pp2-s0-fp32-ws4",
            2,
            {"zero_stage": 1, "pipeline_parallel": 1, "partition_method": "type:Linear"},
            "'type:Linear' is not supported",
        ),
        ("tp2pp2-s0-fp32-ws4", 2, {"zero_stage": 2, "pipeline_parallel": 1}, "--stage 2 for a stage-0 pipeline"),
        ("tp2pp2-s1-bf16-ws4", 3, {"zero_stage": 0, "pipeline_parallel": 1}, "--world-size 3 is not a multiple"),
    ],
)
def test_what_is_not_written_is_refused_before_any_step_runs(
    ds, tmp_path, monkeypatch, source, world_size, options, refusal
):
    """CK410 naming the source while planning: no step of the chain runs, nothing is written (another tensor degree:
    test_reshard_tp_pipe_stage0_degree.py)."""
    assert_refused_while_planning(ds.path(source), tmp_path / "out", monkeypatch, world_size, options, refusal)
