"""#40 (first step): the data axis of a tensor- or pipeline-parallel ZeRO checkpoint resharded, checked by DeepSpeed;
an AutoTP ZeRO-3 checkpoint's at stage 3 or, at the same tensor degree, at stage 1 or 2.

Ground truth: a real job of the source's tensor/pipeline layout at the target world size resumes from what
``ckptspec reshard`` wrote (``engine.load_checkpoint``: tests/_harness/optim_job.py, ``PARALLEL_RESHARDS``)
(or ``DEGREE_RESHARDS``' stage changes of an AutoTP ZeRO-3 source, a job of the target stage) and records, on
every rank, the fp32 masters (``safe_get_full_fp32_param``) and Adam moments
(``safe_get_full_optimizer_state``) it then holds; a job of the source's own layout loading the source
recorded the same (its ``+optim`` entry). Both must agree bit for bit at every (pipeline, tensor) coordinate,
on every data rank, with the step and the hyperparameters.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _harness.parallel_oracles import bits_equal, optim_records
from _harness.scenarios import (
    DEGREE_RESHARDS,
    PARALLEL_RESHARDS,
    PARALLEL_RESHARDS_UNIVERSAL,
    optim_name,
    reshard_target,
    source_spec,
)
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli

# an AutoTP ZeRO-3 checkpoint written at stage 1 or 2, the same tensor degree (each coordinate's partitions)
STAGE_CHANGES = sorted(
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if source_spec(source).get("tp", 1) > 1
    and source_spec(source)["stage"] == 3
    and set(options) == {"stage"}
    and options["stage"] != 0  # a stage-0 job: test_reshard_stage0.py (DeepSpeed's getters give no masters)
)
# a bf16 pipeline's stages for the other optimizer kind (--grad-accum-dtype: ZeRO-1 <-> BF16_Optimizer), pp2 x dp2
KIND_CHANGES = sorted(n for n, (*_, options) in DEGREE_RESHARDS.items() if "grad_accum_dtype" in options)
RESHARDS = sorted(PARALLEL_RESHARDS) + STAGE_CHANGES + KIND_CHANGES


def _by_coordinate(records: list[dict]) -> dict[tuple[int, int, str], dict]:
    """(pipeline stage, tensor rank, parameter) -> master, moments, step: equal on every data rank."""
    out: dict[tuple[int, int, str], dict] = {}
    for record in records:
        pp, tp = record["coords"]["pp"], record["coords"]["tp"]
        for name, master in record["master"].items():
            value = {
                "master": master.numpy(),
                **{k: v.numpy() for k, v in record["state"][name].items()},
                "step": record["step"][name],
            }
            seen = out.setdefault((pp, tp, name), value)
            for key, array in value.items():  # every data rank of the coordinate holds the same
                assert np.array_equal(np.asarray(seen[key]), np.asarray(array)), (pp, tp, name, key)
    return out


@pytest.mark.parametrize("name", RESHARDS)
def test_a_job_of_the_target_world_size_resumes_the_source_bit_for_bit(name, ds):
    source, world_size, _ = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    model_parallel = len(before) // before[0]["coords"]["dp_world_size"]  # tp x pp, kept
    assert {r["coords"]["dp_world_size"] for r in target} == {world_size // model_parallel}
    resumed, held = _by_coordinate(target), _by_coordinate(before)
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
    assert [r["param_groups"] for r in target][0] == before[0]["param_groups"]


@pytest.mark.parametrize("name", sorted(PARALLEL_RESHARDS_UNIVERSAL))
def test_deepspeeds_own_path_holds_the_same_bits(name, ds):
    """The same job loads DeepSpeed's ds_to_universal folder of the source (``load_universal``): on every rank the
    same masters, moments, step, param groups and logits as from ckptspec's output."""
    entry = ds.path(name)
    assert json.loads((entry / "optim.json").read_text())["universal_error"] is None
    ours, theirs = optim_records(entry), optim_records(entry, "universal")
    assert [r["coords"] for r in ours] == [r["coords"] for r in theirs] and len(ours) == PARALLEL_RESHARDS[name][1]
    for got, expected in zip(theirs, ours):
        assert got["master"].keys() == expected["master"].keys() and expected["master"]
        for param, master in expected["master"].items():
            pairs = [
                (got["master"][param], master),
                *((got["state"][param][k], v) for k, v in expected["state"][param].items()),
            ]
            for a, b in pairs:
                assert np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8)), param
        assert got["step"] == expected["step"] and got["param_groups"] == expected["param_groups"]
        if expected["logits"] is None:  # a pipeline's: its last stage's ranks record them
            assert got["logits"] is None
            continue
        assert bits_equal(got["logits"], expected["logits"])  # bf16 too


@pytest.mark.parametrize("name", RESHARDS)
def test_the_resharded_checkpoint_is_the_source_to_ckptspec(name, ds):
    """What ckptspec reads of the output: valid from its files, the same whole model and optimizer state."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    degrees = after.index.topology.degrees
    assert degrees.data * degrees.tensor * degrees.pipeline == world_size
    assert {d.manifest.layout.zero_stage for d in after.index.domains} == {spec["stage"]}
    assert (degrees.tensor, degrees.pipeline) == (
        before.index.topology.degrees.tensor,
        before.index.topology.degrees.pipeline,
    )
    expected, got = before.state_dict(framework="numpy"), after.state_dict(framework="numpy")
    assert list(got) == list(expected) and expected
    for key, array in expected.items():
        assert np.array_equal(got[key].view(np.uint8), array.view(np.uint8)), key
    (states, optimizer), (states_after, optimizer_after) = before.optimizer_state(), after.optimizer_state()
    if name in KIND_CHANGES:  # the loss scaler a bf16 ZeRO job saves (static, 1.0) and BF16_Optimizer keeps none of
        scalers = [optimizer.pop("loss_scaler", None), optimizer_after.pop("loss_scaler", None)]
        assert sorted(scalers, key=repr) == sorted(
            [None, {"kind": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}}], key=repr
        )
    assert optimizer_after == optimizer and list(states_after) == list(states)
    for key, per_state in states.items():
        for state, array in per_state.items():
            array, other = np.asarray(array), np.asarray(states_after[key][state])
            assert np.array_equal(other.view(np.uint8), array.view(np.uint8)), (key, state)


def test_a_world_size_the_model_parallel_degrees_do_not_divide_is_refused(ds, tmp_path):
    """CK410 before anything is written, naming the degrees."""
    result = CliRunner().invoke(
        cli, ["reshard", str(ds.path("tp2dp2-s2-bf16-ws4")), str(tmp_path / "out"), "--world-size", "3"]
    )
    assert result.exit_code == 1 and "CK410" in result.output and "tensor x pipeline" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
