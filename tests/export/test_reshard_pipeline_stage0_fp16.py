"""#40: an fp16 PipelineModule checkpoint saved at ZeRO stage 0 (FP16_UnfusedOptimizer around the client torch Adam)
written for an fp16 stage-0 pipeline job at another data degree (``reshard --world-size 4``: pp2 x dp1 -> pp2 x dp2;
export/reshard_pipeline_stage0_fp32.py with its loss scale).

Ground truth: a real DeepSpeed fp16 pipeline job at stage 0 of the target layout resumes from what ``ckptspec reshard``
wrote with a plain ``engine.load_checkpoint`` (``DEGREE_RESHARDS``) and records the Adam moments and step its torch
optimizer holds for each parameter, the param groups, FP16_UnfusedOptimizer's loss scale with its dynamic-scale
counters and the logits of a fixed batch; the source's own job (its ``+optim`` entry) recorded the same after loading
the source: every value equal, bit for bit. DeepSpeed's getters answer None outside ZeRO and BF16_Optimizer, so the
fp32 masters are compared as written (``fp32_groups``) with the ones the source's job held (its oracle). One more step:
tests/export/test_reshard_one_more_step.py (both jobs FP16_UnfusedOptimizer, so DeepSpeed's fp16 stage-0 step defect
moves both alike). Every other fp16 stage-0 pipeline move is refused by name (CK410).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import bits_equal, logits_of, optim_records, rank_oracles, union_of
from _harness.scenarios import DEGREE_RESHARDS, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

CASES = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source).get("pp") and source_spec(source)["stage"] == 0 and source_spec(source)["dtype"] == "fp16"
)
DYNAMIC = {"dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window"}


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_the_cases():
    assert CASES == ["pp2-s0-fp16-ws2>ws4"]


@pytest.mark.parametrize("name", CASES)
def test_a_stage0_fp16_pipeline_job_resumes_the_output_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and all(r["coords"]["dp_world_size"] == world_size // 2 for r in target)
    assert {s for r in [*target, *before] for s in r["source"].values()} == {"FP16_UnfusedOptimizer.fp32_groups"}
    for key in ("exp_avg", "exp_avg_sq"):
        held = union_of([{n: v[key] for n, v in r["state"].items()} for r in target])
        expected = union_of([{n: v[key] for n, v in r["state"].items()} for r in before])
        assert held.keys() == expected.keys() and len(held) == 12
        assert all(bits_equal(held[n], value) for n, value in expected.items()), key
    steps = {s for r in target for s in r["step"].values()}
    assert steps == {s for r in before for s in r["step"].values()} == {3.0}
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    # FP16_UnfusedOptimizer's dynamic scale with its counters, as the source's own job holds it after loading
    assert all(r["loss_scaler"] == before[0]["loss_scaler"] for r in target)
    assert DYNAMIC <= set(before[0]["loss_scaler"]) and before[0]["loss_scaler"]["dynamic_loss_scale"] is True
    # the fp32 masters as written: the ones the source's job held (its oracle)
    written = ckptspec.open(entry / "resharded").state_dict(framework="torch")
    expected_masters = union_of([oracle["masters"] for oracle in rank_oracles(ds.path(source))])
    assert written.keys() == expected_masters.keys() and len(written) == 12
    assert all(written[n].dtype == torch.float32 and bits_equal(written[n], m) for n, m in expected_masters.items())
    logits = logits_of(target)  # the module the job loaded from the (fp16) layer files
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", CASES)
def test_the_files_are_the_source_at_the_target_data_degree(name, ds):
    """Valid from its files, an fp16 stage-0 pipeline of 2 stages; each stage's model states the source's entry for
    entry (FP16_UnfusedOptimizer's keys in its order, the loss scale as saved) but ``dp_world_size``; layer files as
    saved, no optimizer-state files."""
    source, world_size, _ = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    after = ckptspec.open(out)
    assert after.kind == Kind.PIPELINE_STAGE0 and len(after.domains) == 2
    assert all(d.masters and d.masters.stored_in == "model_states" for d in after.domains)
    ours, theirs = tag_dir(out), tag_dir(ds.path(source))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files and not any("optim_states" in f for f in files)
    for file in files:
        if file.startswith("layer_"):
            assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file
            continue
        mine, native = _load(ours / file), _load(theirs / file)
        assert list(mine) == list(native) and (mine["dp_world_size"], native["dp_world_size"]) == (world_size // 2, 1)
        assert list(mine["optimizer"]) == list(native["optimizer"])
        assert {k: mine["optimizer"][k] for k in DYNAMIC} == {k: native["optimizer"][k] for k in DYNAMIC}
        for ours_master, saved in zip(mine["optimizer"]["fp32_groups"][0], native["optimizer"]["fp32_groups"][0]):
            assert bits_equal(ours_master, saved)


@pytest.mark.parametrize(
    "args,refusal",
    [
        (
            ["--world-size", "3", "--pipeline-parallel", "3", "--stage", "0"],
            "float16 pipeline (stage pp0-tp0) at other",
        ),
        (["--world-size", "2", "--stage", "1"], "does not save the hysteresis state a ZeRO job's loss scaler holds"),
    ],
)
def test_what_is_not_written_is_refused_by_name(args, refusal, ds, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reshard", str(ds.path("pp2-s0-fp16-ws2")), str(out), *args])
    assert result.exit_code == 1 and "CK410" in result.output and refusal in result.output, result.output
    assert not out.exists() or not any(out.iterdir())
