"""#40: a bf16 PipelineModule checkpoint written for a pipeline job at ZeRO stage 0 (``reshard --stage 0``: DeepSpeed's
BF16_Optimizer files, export/reshard_pipeline_stage0.py), from a ZeRO-1 pipeline (at its stages, or restaged) and
from a stage-0 pipeline at another data degree.

Ground truth: a real DeepSpeed pipeline job at stage 0 of the target layout resumes from what ``ckptspec reshard``
wrote (tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records the fp32 masters (``safe_get_full_fp32_param``:
BF16_Optimizer keeps fragment mappings), Adam moments, step, param groups and the logits of a fixed batch; the
source's own job (its ``+optim`` entry) recorded the same after loading the source: every value equal, bit for bit.
DeepSpeed 0.19.8's ``engine.load_checkpoint`` fails on the optimizer state of its own stage-0 pipeline save
(``KeyError: 0``: it hands BF16_Optimizer the model states' copy of rank 0's state where it indexes a list of every
rank's); the job then loads the module with ``load_optimizer_states=False`` and the optimizer state with DeepSpeed's
own ZeRO-file reader (``engine._load_zero_checkpoint``), for ckptspec's output and DeepSpeed's save alike. The files
are compared with DeepSpeed's own stage-0 saves of the same model at the target layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import (
    assert_same,
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
    if source_spec(source).get("pp") and reshard_target(n)[2]["stage"] == 0 and source_spec(source)["dtype"] == "bf16"
)  # an fp32 pipeline's: test_reshard_pipeline_stage0_fp32.py
# DeepSpeed's own stage-0 save of the same bf16 pipeline, by (stages, world size)
NATIVE = {(2, 2): "pp2-s0-bf16-ws2", (2, 4): "pp2dp2-s0-bf16-ws4"}
LAYERS = 5  # job/parallel_models.py's pipeline (layer 1 without parameters)


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_the_cases_cover_every_source_and_move():
    """ZeRO-1 sources at the same and another data degree, a stage-0 source at another one, a restage."""
    assert {DEGREE_RESHARDS[n][0] for n in CASES} >= {"pp2-s1-bf16-ws2", "pp2dp2-s1-bf16-ws4", "pp2-s0-bf16-ws2"}
    assert any("pipeline_parallel" in DEGREE_RESHARDS[n][3] for n in CASES)


@pytest.mark.parametrize("name", CASES)
def test_a_stage0_pipeline_job_resumes_the_output_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    # load_checkpoint fails on the optimizer state exactly as on DeepSpeed's own stage-0 pipeline save
    native = json.loads((ds.path(optim_name("pp2-s0-bf16-ws2")) / "optim.json").read_text())
    assert outcome["load_checkpoint_error"] == native["load_checkpoint_error"] == "KeyError: 0", outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    stages = spec["pp"]
    bounds = partition_uniform(LAYERS, stages)
    held = {(r["coords"]["pp"], tuple(r["coords"]["stage_layers"])) for r in target}
    assert held == {(s, (bounds[s], bounds[s + 1])) for s in range(stages)}, held
    assert all(r["coords"]["dp_world_size"] == world_size // stages for r in target)
    # BF16_Optimizer's getters answer: every master and moment comes from DeepSpeed's own fragment mapping
    assert all(
        set(r["source"].values()) == {"safe_get_full_optimizer_state"} and all(r["getter"].values()) for r in target
    )
    masters, loaded = union_of([r["master"] for r in target]), union_of([r["master"] for r in before])
    assert masters.keys() == loaded.keys() and masters
    for n, master in masters.items():
        assert bits_equal(master, loaded[n]), n
    if source_spec(source)["stage"] == 0:  # and what the stage-0 job held when it saved
        saved = union_of([oracle["masters"] for oracle in rank_oracles(ds.path(source))])
        assert all(bits_equal(master, saved[n]) for n, master in masters.items())
    check_same_moments_and_step(target, before, masters)
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)


@pytest.mark.parametrize("name", CASES)
def test_the_logits_carry_over(name, ds):
    """The last stage's logits of a fixed batch: the source layout's, bit for bit (the same layers, whatever stage
    runs them)."""
    source = DEGREE_RESHARDS[name][0]
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    logits = logits_of(target)
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", [n for n in CASES if (reshard_target(n)[2]["pp"], reshard_target(n)[1]) in NATIVE])
def test_the_files_are_deepspeeds_own_stage0_save(name, ds):
    """The file names, every key, tensor dtype and shape, and every layout entry (partition counts, paddings,
    ``param_slice_mappings``, degrees, the saved stage) of DeepSpeed's own stage-0 save at the target layout. Its run
    is another training run: values that depend on it (tensors, the samples seen) are not compared here."""
    source, world_size, spec = reshard_target(name)
    ours, theirs = tag_dir(ds.path(name) / "resharded"), tag_dir(ds.path(NATIVE[(spec["pp"], world_size)]))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    assert sum(f.startswith("bf16_zero_pp_rank_") for f in files) == world_size
    allowed = {"/global_samples"}  # the source's training history: the samples it saw at its world size
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert list(mine) == list(native), file
        differ = {k for k in mine if mine[k] != native[k]}  # a tensor's entry: its dtype and shape
        assert differ <= allowed, (file, {k: (mine[k], native[k]) for k in differ})


def test_the_same_layout_is_deepspeeds_save_bit_for_bit(ds, tmp_path):
    """DeepSpeed's stage-0 pipeline save written anew at its own layout: every file, key and value (tensors bit for
    bit) is the saved one; the command names the load that resumes it (load_checkpoint alone fails, KeyError: 0)."""
    source = ds.path("pp2-s0-bf16-ws2")
    result = CliRunner().invoke(
        cli, ["reshard", str(source), str(tmp_path / "out"), "--world-size", "2", "--stage", "0"]
    )
    assert result.exit_code == 0, result.output
    assert "load_optimizer_states=False), then engine._load_zero_checkpoint(" in result.output
    ours, theirs = tag_dir(tmp_path / "out"), tag_dir(source)
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    for file in files:
        assert_same(_load(ours / file), _load(theirs / file), file)


@pytest.mark.parametrize("name", CASES)
def test_the_output_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a stage-0 pipeline of the target's degrees, the same whole model and optimizer state."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == Kind.PIPELINE_STAGE0 and len(after.domains) == spec["pp"]
    assert all(d.manifest.layout.world_size == world_size // spec["pp"] for d in after.domains)
    # a stage-0 optimizer records no loss scaler (a ZeRO-1 source's is the static 1.0 every ZeRO file pickles)
    check_same_to_ckptspec(before, after, optimizer_keys=("groups",))


def test_deepspeeds_own_save_of_two_data_ranks_reads_as_its_job_held_it(ds):
    """DeepSpeed's pp2 x dp2 stage-0 save: data rank 0's copy in the model states holds its own partition only, so a
    master it holds in part is no copy (CK202 before: read as a copy of the whole master); the masters are the job's."""
    entry = ds.path("pp2dp2-s0-bf16-ws4")
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.PIPELINE_STAGE0 and [d.manifest.layout.world_size for d in opened.domains] == [2, 2]
    masters = union_of([oracle["masters"] for oracle in rank_oracles(entry)])
    read = opened.state_dict(framework="torch")
    assert read.keys() == masters.keys() and all(bits_equal(read[n], m) for n, m in masters.items())


def test_deepspeeds_fp32_stage0_pipeline_is_another_layout(ds):
    """Why an fp32 pipeline is not written as BF16_Optimizer's files at stage 0: DeepSpeed 0.19.8's fp32 pipeline
    job at stage 0 runs the torch optimizer itself (no BF16_Optimizer): no optimizer-state files, each stage's model
    states hold the torch optimizer's state per parameter, its masters are the layer files' fp32 weights. ckptspec
    describes that save (tests/deepspeed/test_fp32_pipeline_stage0.py) and writes it
    (test_reshard_pipeline_stage0_fp32.py)."""
    entry = ds.path("pp2-s0-fp32-ws2")
    tag = tag_dir(entry)
    names = sorted(p.name for p in tag.iterdir())
    assert not any("optim_states" in n for n in names) and "mp_rank_01_model_states.pt" in names
    states = _load(tag / "mp_rank_00_model_states.pt")
    assert states["param_shapes"] is None and list(states["optimizer"]) == ["state", "param_groups"]
    shapes = [tuple(s["exp_avg"].shape) for s in states["optimizer"]["state"].values()]
    assert shapes == [(16, 16), (16,), (32, 16), (32,), (16, 32), (16,)]  # stage 0's parameters, whole
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.PIPELINE_STAGE0 and all(d.masters.stored_in == "module" for d in opened.domains)


@pytest.mark.parametrize(
    "source,options,refusal",
    [
        # refused by the restage of its ZeRO-1 pipeline (written first, in a temporary directory): named as the source
        ("pp2-s0-bf16-ws2", {"pipeline_parallel": 6}, "5 layers, fewer than the stages"),
        ("pp2-s1-fp32-ws2", {"pipeline_parallel": 6}, "5 layers, fewer than the stages"),  # fp32 too
        ("pp2-s0-fp32-ws2", {"pipeline_parallel": 6}, "5 layers, fewer than the stages"),
        ("pp2-s1-bf16-ws2", {"pipeline_parallel": 6}, "5 layers, fewer than the stages"),  # the restage's own
    ],
)
def test_what_is_not_written_is_refused_by_name(source, options, refusal, ds, tmp_path):
    from ckptspec.export.reshard_parallel import reshard_model_parallel

    with pytest.raises(ckptspec.Unsupported) as refused:
        reshard_model_parallel(ds.path(source), tmp_path / "out", 6, zero_stage=0, **options)
    assert refused.value.code == "CK410" and refusal in refused.value.message, refused.value.message
    assert refused.value.file == str(ds.path(source)), refused.value.file
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_cli_refuses_without_a_traceback(ds, tmp_path):
    out = tmp_path / "out"
    args = ["reshard", str(ds.path("pp2-s0-bf16-ws2")), str(out), "--world-size", "3", "--stage", "0"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "CK410" in result.output and "not a multiple" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not out.exists() or not any(out.iterdir())
