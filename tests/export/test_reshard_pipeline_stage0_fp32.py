"""#40: an fp32 PipelineModule checkpoint written for an fp32 pipeline job at ZeRO stage 0 (``reshard --stage 0``:
each stage's model states holding the torch optimizer's ``state_dict()``, no optimizer-state files,
export/reshard_pipeline_stage0_fp32.py), from a ZeRO-1 pipeline (pp2 x dp1 and pp2 x dp2) and from DeepSpeed's own
fp32 stage-0 pipeline save at another data degree.

Ground truth: a real DeepSpeed fp32 pipeline job at stage 0 of the target layout resumes from what ``ckptspec
reshard`` wrote with a plain ``engine.load_checkpoint`` (tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records
the Adam moments and step its torch optimizer holds for each parameter, the param groups and the logits of a fixed
batch; the source's own job (its ``+optim`` entry) recorded the same after loading the source: every value equal, bit
for bit. DeepSpeed's getters answer None outside ZeRO and BF16_Optimizer, so the masters (the layer files' fp32
weights, which such a job trains) are compared as written with the source's (its job's oracle for a stage-0 source).
The files are compared with DeepSpeed's own fp32 stage-0 saves at the target layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import (
    bits_equal,
    check_same_moments_and_step,
    check_same_to_ckptspec,
    logits_of,
    optim_records,
    rank_oracles,
    saved_entries,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind
from ckptspec.export.reshard_pipeline import partition_uniform

CASES = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source).get("pp") and reshard_target(n)[2]["stage"] == 0 and source_spec(source)["dtype"] == "fp32"
)
# DeepSpeed's own fp32 stage-0 save of the same pipeline, by (stages, world size)
NATIVE = {(2, 2): "pp2-s0-fp32-ws2", (2, 4): "pp2dp2-s0-fp32-ws4"}
LAYERS = 5  # job/parallel_models.py's pipeline (layer 1 without parameters)


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_the_cases_cover_every_source():
    """ZeRO-1 sources at the same and another data degree, a stage-0 source at another one, restages."""
    assert {DEGREE_RESHARDS[n][0] for n in CASES} == {"pp2-s1-fp32-ws2", "pp2dp2-s1-fp32-ws4", "pp2-s0-fp32-ws2"}
    assert {DEGREE_RESHARDS[n][0] for n in CASES if "pipeline_parallel" in DEGREE_RESHARDS[n][3]} == {
        "pp2-s1-fp32-ws2",
        "pp2-s0-fp32-ws2",
    }


@pytest.mark.parametrize("name", CASES)
def test_a_stage0_fp32_pipeline_job_resumes_the_output_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    assert all(r["coords"]["dp_world_size"] == world_size // spec["pp"] for r in target)
    bounds = partition_uniform(LAYERS, spec["pp"])  # 2 stages: the source's cut; 3: uniform
    held = {(r["coords"]["pp"], tuple(r["coords"]["stage_layers"])) for r in target}
    assert held == {(s, (bounds[s], bounds[s + 1])) for s in range(spec["pp"])}, held
    # the torch optimizer steps the parameters themselves: its state is read from them (no getter answers)
    assert all(set(r["source"].values()) == {"module (fp32, no masters)"} for r in target)
    # the masters: the output's layer files hold the source's, bit for bit (the stage-0 source's job's oracle)
    written = ckptspec.open(entry / "resharded").state_dict(framework="torch")
    if source_spec(source)["stage"] == 0:
        expected = union_of([oracle["masters"] for oracle in rank_oracles(ds.path(source))])
    else:
        expected = ckptspec.open(ds.path(source)).state_dict(framework="torch")
    assert written.keys() == expected.keys() and len(written) == 12
    assert all(bits_equal(written[n], m) for n, m in expected.items())
    check_same_moments_and_step(target, before, written)
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    logits = logits_of(target)  # the module the job loaded from the layer files
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", CASES)
def test_the_output_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, an fp32 stage-0 pipeline of the target's degrees, the same model and optimizer state."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == Kind.PIPELINE_STAGE0 and len(after.domains) == spec["pp"]
    assert all(d.masters and d.masters.stored_in == "module" for d in after.domains)
    assert all(d.manifest.layout.world_size == world_size // spec["pp"] for d in after.domains)
    check_same_to_ckptspec(before, after, optimizer_keys=("groups",))


@pytest.mark.parametrize("name", [n for n in CASES if (reshard_target(n)[2]["pp"], reshard_target(n)[1]) in NATIVE])
def test_the_files_are_deepspeeds_own_stage0_save(name, ds):
    """The file names, every key, tensor dtype and shape and every other entry (degrees, the saved stage, param
    groups) of DeepSpeed's own fp32 stage-0 save at the target layout: no optimizer-state files. Its run is another
    training run: the samples it saw at its world size may differ."""
    source, world_size, spec = reshard_target(name)
    ours, theirs = tag_dir(ds.path(name) / "resharded"), tag_dir(ds.path(NATIVE[(spec["pp"], world_size)]))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files and not any("optim_states" in f for f in files)
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert list(mine) == list(native), file
        differ = {k for k in mine if mine[k] != native[k]}  # a tensor's entry: its dtype and shape
        assert differ <= {"/global_samples"}, (file, {k: (mine[k], native[k]) for k in differ})


def test_the_same_layout_is_deepspeeds_save_byte_for_byte(ds, tmp_path):
    """DeepSpeed's fp32 stage-0 pipeline save written anew at its own layout: every file's bytes are the saved
    file's; the command names plain load_checkpoint (it loads such a checkpoint, unlike a bf16 one)."""
    source = ds.path("pp2-s0-fp32-ws2")
    result = CliRunner().invoke(
        cli, ["reshard", str(source), str(tmp_path / "out"), "--world-size", "2", "--stage", "0"]
    )
    assert result.exit_code == 0, result.output
    assert f"resume with engine.load_checkpoint('{tmp_path / 'out'}')" in result.output, result.output
    ours, theirs = tag_dir(tmp_path / "out"), tag_dir(source)
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    for file in files:
        assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file
