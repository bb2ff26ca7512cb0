"""#40: ``ckptspec reshard --pipeline-parallel N`` of a PipelineModule's ZeRO-1 checkpoint, checked by DeepSpeed.

Ground truth: a real job of the target layout (``DEGREE_RESHARDS``: another number of stages, the target's
partition method) resumes from what ``ckptspec reshard`` wrote (``engine.load_checkpoint``:
tests/_harness/optim_job.py) and records, on every rank, the fp32 masters (``safe_get_full_fp32_param``) and
Adam moments (``safe_get_full_optimizer_state``) it then holds; a job of the source's own layout loading the
source recorded the same (its ``+optim`` entry). Both must agree bit for bit for every global parameter name
(``layer.attr``), with the step and the hyperparameters; the stages hold the layers DeepSpeed's own partition
gives them; the target model's logits are the source's, bit for bit; the files are named and keyed as a real
job of the target layout saves them.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from _harness.parallel_oracles import check_same_to_ckptspec, optim_records, running_layers
from _harness.scenarios import DEGREE_RESHARDS, optim_name, reshard_target
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.export.reshard_pipeline import partition_balanced, partition_uniform

# at ZeRO-1 (a stage-0 target's, restaged first: test_reshard_pipeline_stage0.py)
RESHARDS = sorted(
    n
    for n, (_, _, _, options) in DEGREE_RESHARDS.items()
    if "pipeline_parallel" in options and reshard_target(n)[2]["stage"] != 0
)
# a real job's save of the target layout, beside a reshard whose output has the same layout and model
SAME_LAYOUT = {
    "pp2-s1-fp32-ws2>pp1": "pp1-s1-fp32-ws2",
    "pp1-s1-fp32-ws2>pp2": "pp2-s1-fp32-ws2",
    # a TiedLayerSpec, a frozen weight and a buffer (PIPE_TARGET_SPECS)
    "pp2-s1-fp32-ws2-extras>pp1": "pp1-s1-fp32-ws2-extras",
    "pp2-s1-fp32-ws2-extras>pp3": "pp3-s1-fp32-ws3-extras",
    "pp1-s1-fp32-ws2-extras>pp2": "pp2-s1-fp32-ws2-extras",
}


def _by_name(records: list[dict]) -> dict[str, dict]:
    """Global parameter name -> master, moments, step: the same on every rank that holds it."""
    out: dict[str, dict] = {}
    for record in records:
        for name, master in record["master"].items():
            value = {
                "master": master.numpy(),
                **{k: v.numpy() for k, v in record["state"][name].items()},
                "step": record["step"][name],
            }
            seen = out.setdefault(name, value)
            for key, array in value.items():
                assert np.array_equal(np.asarray(seen[key]), np.asarray(array)), (name, key)
    return out


@pytest.mark.parametrize("name", RESHARDS)
def test_a_job_of_the_target_pipeline_degree_resumes_the_source_bit_for_bit(name, ds):
    source, world_size, changes, _ = DEGREE_RESHARDS[name]
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    stages = reshard_target(name)[2]["pp"]
    assert {r["coords"]["pp"] for r in target} == set(range(stages))
    assert {r["coords"]["dp_world_size"] for r in target} == {world_size // stages}
    resumed, held = _by_name(target), _by_name(before)
    assert resumed.keys() == held.keys() and held
    for key, value in held.items():
        for part, array in value.items():
            got = resumed[key][part]
            if part == "step":
                assert got == array, key
            else:
                assert got.dtype == array.dtype and np.array_equal(got.view(np.uint8), array.view(np.uint8)), (
                    key,
                    part,
                )
    assert target[0]["param_groups"] == before[0]["param_groups"]
    # each stage holds the parameters of the layers DeepSpeed's PipelineModule gave it (a tied module's where one of
    # its layers runs), and no other
    spec = reshard_target(name)[2]
    for record in target:
        start, stop = record["coords"]["stage_layers"]
        for n in record["master"]:
            assert running_layers(spec, n) & set(range(start, stop)), (n, record["coords"])


@pytest.mark.parametrize("name", RESHARDS)
def test_the_target_model_computes_the_sources_logits_bit_for_bit(name, ds):
    """The last stage's output on a fixed batch (``engine.eval_batch``) after loading: the target job's equals
    the source layout's job's, bit for bit (each layer runs the same operations on the same weights)."""
    source = DEGREE_RESHARDS[name][0]

    def logits(records):
        found = [r["logits"].float().numpy() for r in records if r.get("logits") is not None]
        assert found, "no last stage recorded logits"
        assert all(np.array_equal(found[0].view(np.uint8), f.view(np.uint8)) for f in found)  # every data rank
        return found[0]

    got, expected = logits(optim_records(ds.path(name))), logits(optim_records(ds.path(optim_name(source))))
    assert got.shape == expected.shape and np.array_equal(got.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("name", RESHARDS)
def test_the_resharded_pipeline_is_the_source_to_ckptspec(name, ds):
    """What ckptspec reads of the output: valid from its files, the same whole model and optimizer state."""
    source, world_size, _, options = DEGREE_RESHARDS[name]
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    degrees = after.index.topology.degrees
    assert (degrees.pipeline, degrees.tensor, degrees.data) == (
        options["pipeline_parallel"],
        1,
        world_size // options["pipeline_parallel"],
    )
    check_same_to_ckptspec(before, after)


def _layout_entries(state: dict) -> dict:
    """What a file's layout decides (its tensors' values aside)."""
    if "optimizer_state_dict" in state:
        osd = state["optimizer_state_dict"]
        return {
            "keys": list(osd),
            **{k: osd[k] for k in ("group_paddings", "param_alignment_paddings", "partition_count", "zero_stage")},
            "param_slice_mappings": [dict(m) for m in osd["param_slice_mappings"]],
            "masters": [t.shape for t in osd["single_partition_of_fp32_groups"]],
            "moments": {
                g: {k: getattr(v, "shape", None) for k, v in s.items()}
                for g, s in osd["base_optimizer_state"]["state"].items()
            },
        }
    if "module" in state:  # model states
        keep = ("param_shapes", "buffer_names", "shared_params", "dp_world_size", "mp_world_size")
        keep += ("checkpoint_parallel_dimensions", "module", "frozen_param_shapes")
        return {"keys": list(state), **{k: state[k] for k in keep}}
    return {"keys": list(state), "shapes": {k: v.shape for k, v in state.items()}}  # a layer file


@pytest.mark.parametrize("name", sorted(SAME_LAYOUT))
def test_the_files_are_named_and_laid_out_as_a_real_job_of_the_target_layout_saves_them(name, ds):
    """The reshard's files against a real save of the same model at the target layout (another training run:
    only what the layout decides is compared): names, keys, shapes, ZeRO paddings, partition counts, slice
    mappings, the stage's param_shapes, buffer_names and shared parameters and the degrees its model states
    record; each layer file's keys and shapes (a tied module's copy in each of its layers' files)."""
    out = ds.path(name) / "resharded"
    real = ds.path(SAME_LAYOUT[name])
    tag, real_tag = (out / (out / "latest").read_text()), (real / (real / "latest").read_text())
    names = sorted(p.name for p in tag.iterdir() if p.suffix == ".pt")
    assert names == sorted(p.name for p in real_tag.iterdir() if p.suffix == ".pt")
    for file in names:
        ours, theirs = (torch.load(d / file, weights_only=False) for d in (tag, real_tag))
        assert _layout_entries(ours) == _layout_entries(theirs), file


def test_the_partition_methods_are_deepspeeds(ds):
    """ckptspec's own partitions equal DeepSpeed's ``partition_uniform`` / ``partition_balanced`` (run here)."""
    from deepspeed.runtime.utils import partition_balanced as ds_balanced
    from deepspeed.runtime.utils import partition_uniform as ds_uniform

    rng = random.Random(40)
    for _ in range(400):
        n, parts = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.choice([0, 0, 1, 5, 85, 272, 1072, rng.randint(0, 3000)]) for _ in range(n)]
        assert partition_uniform(n, parts) == ds_uniform(n, parts), (n, parts)
        assert partition_balanced(weights, parts) == [int(x) for x in ds_balanced(weights, parts)], (weights, parts)


def test_a_zero2_target_is_refused_as_deepspeed_refuses_it(ds, tmp_path):
    """DeepSpeed's PipelineEngine asserts ZeRO < 2: CK410 by name, nothing written."""
    result = CliRunner().invoke(
        cli,
        ["reshard", str(ds.path("pp2-s1-fp32-ws2")), str(tmp_path / "out"), "--world-size", "2"]
        + ["--pipeline-parallel", "1", "--stage", "2"],
    )
    assert result.exit_code == 1 and "CK410" in result.output and "ZeRO-2" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("source", "args", "code", "says"),
    [
        ("pp2-s1-fp32-ws2", ["--world-size", "6", "--pipeline-parallel", "6"], "CK410", "5 layers, fewer than the"),
        ("pp1-s1-fp32-ws2", ["--world-size", "3", "--pipeline-parallel", "2"], "CK410", "not a multiple of --pipeline"),
        (
            "pp2-s0-bf16-ws2",
            ["--world-size", "6", "--pipeline-parallel", "6", "--stage", "1"],
            "CK410",
            "5 layers, fewer than the",
        ),
        (
            "pp2-s1-fp32-ws2-extras",
            ["--world-size", "6", "--pipeline-parallel", "6", "--partition-method", "uniform"],
            "CK410",
            "target stage 1 (layers 1-1, partition method 'uniform') has no trainable parameter",
        ),
    ],
)
def test_what_a_pipeline_change_cannot_write_is_refused_by_name(source, args, code, says, ds, tmp_path):
    """Before anything is written: too many stages (of a stage-0 BF16_Optimizer pipeline too, planned as the ZeRO-1
    pipeline it is written as first), a world size the stages do not divide, a stage holding only a layer
    without parameters (the ReLU of the pipeline with a TiedLayerSpec, a frozen weight and a buffer)."""
    result = CliRunner().invoke(cli, ["reshard", str(ds.path(source)), str(tmp_path / "out"), *args])
    assert result.exit_code == 1 and code in result.output and says in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
