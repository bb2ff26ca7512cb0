"""#40: a ZeRO-1/2/3 checkpoint written for a ZeRO stage-0 job (``reshard --stage 0``, export/reshard_stage0.py).

Ground truth: a real DeepSpeed stage-0 job of the same dense MLP (``DEGREE_RESHARDS``, tests/_harness/optim_job.py)
at the target world size resumes from what ``ckptspec reshard`` wrote (``engine.load_checkpoint``) and records the
Adam moments and step its optimizer then holds (fp32: the client torch optimizer's state of each parameter;
bf16/fp16: the wrapped torch optimizer's state of each fp32 master, ``FP16_UnfusedOptimizer``), its param groups,
buffers and the logits of a fixed batch. The source's own "+optim" job recorded the same after loading the source at
its own layout (a ZeRO-3 source: ``optim_universal_job.py``'s "source" record, and its training job's masters).

DeepSpeed's getters answer None at stage 0 (``safe_get_full_fp32_param``: no fragment mapping), so the job records
no masters; ``FP16_UnfusedOptimizer.load_state_dict`` copies its masters from the file's ``fp32_groups`` as saved,
and at fp32 the module's weights are the masters: the file's masters are compared with the source job's, and the
fp32 target's logits with the source's.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import check_same_to_ckptspec, info, merged, optim_records, rank_oracles
from _harness.scenarios import (
    DEGREE_RESHARDS,
    OPTIM_UNIVERSAL_SOURCES,
    RESUME_SOURCE_SPECS,
    STAGE0_RESHARD_CASES,
    is_moe_to_stage0,
    optim_name,
    reshard_target,
    source_spec,
)
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind
from ckptspec.errors import ReshardUnsupported
from ckptspec.export.plan import plan_reconstruction
from ckptspec.export.reshard import validated_source
from ckptspec.export.reshard_stage0 import module_order, refuse_stage0, source_osd

# dense ones (a MoE's: test_reshard_moe_to_stage0.py)
TO_STAGE0 = sorted(
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    # a pipeline's (BF16_Optimizer's files): test_reshard_pipeline_stage0.py; a stage-0 source's:
    # test_reshard_stage0_world.py
    if options.get("stage") == 0
    and not is_moe_to_stage0(n)
    and not source_spec(source).get("pp")
    and source_spec(source)["stage"] != 0
)
KEYS = ("exp_avg", "exp_avg_sq")
# What DeepSpeed's stage-0 optimizer wrapper is, per dtype (optim_job.py's record "source")
HELD_BY = {"fp32": "module (fp32, no masters)", "bf16": "FP16_UnfusedOptimizer.fp32_groups"}
HELD_BY["fp16"] = HELD_BY["bf16"]
# A real stage-0 save of the same model, dtype, tensor degree and frozen parameters (a client torch Adam): the file's
# shape is compared with it (an AutoTP one of degree 2 in bf16 only; with frozen parameters, the dense bf16 and fp32
# ones)
NATIVE = {("fp32", 1, False): "s0-fp32-ws2", ("bf16", 1, False): "s0-bf16-ws2", ("fp16", 1, False): "s0-fp16-ws2"}
NATIVE[("bf16", 2, False)] = "tp2-s0-bf16-ws2"
NATIVE[("bf16", 1, True)] = "s0-bf16-ws2-frozen"
NATIVE[("fp32", 1, True)] = "s0-fp32-ws2-frozen"
NATIVE[("bf16", 2, True)] = "tp2-s0-bf16-ws2-frozen"


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _one_value(records: list[dict], key: str) -> dict:
    """name -> the value every rank recorded under ``key`` (they must agree: ZeRO gathers whole tensors)."""
    out: dict = {}
    for record in records:
        for name, value in record[key].items():
            if name in out:
                seen = out[name]
                same = all(_equal(seen[k], v) for k, v in value.items()) if isinstance(value, dict) else None
                assert same if same is not None else _equal(seen, value), (key, name)
            out[name] = value
    return out


def _source(ds, source: str) -> dict:
    """What a job of the source's layout held after loading it: masters, moments, steps, param groups (an AutoTP
    source's tensor shards put together: ``parallel_oracles.merged``, by the whole shapes the job recorded)."""
    if source in OPTIM_UNIVERSAL_SOURCES:  # ZeRO-3: optim_universal_job.py's load of the ZeRO tag
        records = optim_records(ds.path(optim_name(source)), "source")
        masters = {n: m for oracle in rank_oracles(ds.path(source)) for n, m in oracle["masters"].items()}
        state = _one_value(records, "state")
    elif _is_autotp(source):
        records = optim_records(ds.path(optim_name(source)))
        shapes = {n: tuple(shape) for n, shape in info(ds.path(source))["global_shapes"].items()}
        masters, state = merged(records, lambda r: r["master"], shapes), _whole_state(records, shapes)
    else:
        records = optim_records(ds.path(optim_name(source)))
        masters, state = _one_value(records, "master"), _one_value(records, "state")
    return {
        "records": records,
        "masters": masters,
        "state": state,
        "steps": {s for r in records for s in r["step"].values()},
    }


def _is_autotp(source: str) -> bool:
    return source_spec(source).get("tp", 1) > 1


def _whole_state(records: list[dict], shapes: dict) -> dict[str, dict[str, torch.Tensor]]:
    """name -> its moments, whole (an AutoTP job's tensor ranks' shards put together; every data rank the same)."""
    moments = {k: merged(records, lambda r, k=k: {n: s[k] for n, s in r["state"].items()}, shapes) for k in KEYS}
    return {n: {k: moments[k][n] for k in KEYS} for n in moments[KEYS[0]]}


def _written(ds, name: str, mp_rank: int = 0) -> dict:
    out = ds.path(name) / "resharded"
    tag = (out / "latest").read_text().strip()
    path = out / tag / f"mp_rank_{mp_rank:02d}_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)


def _file_masters(states: dict, dtype: str, trained) -> dict[str, torch.Tensor]:
    """The fp32 masters the written file holds, by name: the module's weights in fp32, else ``fp32_groups``
    (the module's trainable parameters in order, buffers and frozen parameters left out: DeepSpeed's optimizer
    order); ``trained``: the names the source job trains."""
    buffers = set(states["buffer_names"])
    names = [n for n in states["module"] if n not in buffers and n in trained]
    if dtype == "fp32":
        return {n: states["module"][n] for n in names}
    flat = [m for group in states["optimizer"]["fp32_groups"] for m in group]
    assert len(flat) == len(names)
    return dict(zip(names, flat))


def _written_masters(ds, name: str, shapes: dict) -> dict[str, torch.Tensor]:
    """The masters of every tensor rank's written file (one without tensor parallelism), put together."""
    spec = reshard_target(name)[2]
    per_rank = [
        {"coords": {"tp": tp}, "masters": _file_masters(_written(ds, name, tp), spec["dtype"], shapes)}
        for tp in range(spec.get("tp", 1))
    ]
    return merged(per_rank, lambda r: r["masters"], shapes)


@pytest.mark.parametrize("name", TO_STAGE0)
def test_a_stage0_job_resumes_the_resharded_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), _source(ds, source)
    assert len(target) == world_size
    assert {s for r in target for s in r["source"].values()} == {HELD_BY[spec["dtype"]]}
    assert {r["coords"]["mp_world_size"] for r in target} == {spec.get("tp", 1)}
    shapes = {n: tuple(m.shape) for n, m in before["masters"].items()}
    held = _whole_state(target, shapes)
    assert held.keys() == before["state"].keys() == before["masters"].keys() and held
    for n, value in held.items():
        for key in KEYS:
            assert _equal(value[key], before["state"][n][key]), (n, key)
    steps = {s for r in target for s in r["step"].values()}
    assert steps == before["steps"] and len(steps) == 1, (steps, before["steps"])
    assert all(r["param_groups"] == before["records"][0]["param_groups"] for r in target)
    masters = _written_masters(ds, name, shapes)
    assert masters.keys() == before["masters"].keys()
    for n, master in masters.items():
        assert _equal(master, before["masters"][n]), n


# Another tensor degree's logits: AutoTP's row-parallel layers sum the tensor ranks' partial products (an all-reduce)
# where the whole layer sums them in one matmul: T epsilons of the dtype at the largest logit (T the larger degree),
# as test_reshard_tensor.py's
LOGITS_EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}


@pytest.mark.parametrize("name", [n for n in TO_STAGE0 if reshard_target(n)[0] not in OPTIM_UNIVERSAL_SOURCES])
def test_buffers_and_logits_carry_over(name, ds):
    """The buffers and frozen parameters as loaded and the logits of a fixed batch equal the source job's, bit for
    bit: every rank of a stage-0 job holds the whole model, so the forward is the source's, whatever the world size
    (an AutoTP source's: within LOGITS_EPS). At another tensor degree a frozen weight AutoTP splits is merged or cut
    again: each side's shards put together."""
    source, _, spec = reshard_target(name)
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    module = target[0]["module"]
    assert module.keys() == before[0]["module"].keys()
    assert bool(module) == bool(spec.get("buffers") or spec.get("frozen"))  # the frozen parameters and buffers
    degrees = (source_spec(source).get("tp", 1), spec.get("tp", 1))
    for record in target:  # at the source's tensor degree, each tensor rank's own (a frozen shard AutoTP cut)
        if degrees[0] == degrees[1]:
            held = [r for r in before if r["coords"].get("tp", 0) == record["coords"].get("tp", 0)]
            for n, t in record["module"].items():
                assert _equal(t, held[0]["module"][n]), n
    if degrees[0] != degrees[1]:  # whole: the tensor ranks' shards put together (buffers replicated)
        shapes = {n: tuple(s) for n, s in info(ds.path(source))["global_shapes"].items()}
        shapes.update({n: tuple(t.shape) for n, t in before[0]["module"].items() if n not in shapes})
        held, expected_module = (merged(r, lambda r: r["module"], shapes) for r in (target, before))
        assert held.keys() == expected_module.keys() == module.keys()
        for n, t in held.items():
            assert _equal(t, expected_module[n]), n
    logits, expected = target[0]["logits"], before[0]["logits"]
    assert logits.abs().max() > 0 and all(_equal(r["logits"], logits) for r in target)
    if degrees[0] == degrees[1]:  # the same sums in the same order
        assert _equal(logits, expected)
        return
    bound = max(degrees) * LOGITS_EPS[spec["dtype"]] * expected.abs().max().item()
    assert logits.shape == expected.shape and (logits - expected).abs().max().item() <= bound


def _native(name: str) -> str | None:
    spec = reshard_target(name)[2]
    return NATIVE.get((spec["dtype"], spec.get("tp", 1), bool(spec.get("frozen"))))


@pytest.mark.parametrize(
    ("name", "mp_rank"), [(n, r) for n in TO_STAGE0 if _native(n) for r in range(reshard_target(n)[2].get("tp", 1))]
)
def test_the_file_has_the_shape_of_a_real_stage0_save(name, mp_rank, ds):
    """The same entries as DeepSpeed's own stage-0 save of the same model, dtype and tensor degree (``s0-*``,
    ``tp2-s0-*``: each tensor rank's file): keys, the optimizer's keys, every tensor's dtype and shape, the entries a
    stage-0 save leaves None; only the world size recorded differs. The loss scale is the source's (its loss scaler's
    ``cur_scale``)."""
    source, world_size, spec = reshard_target(name)
    ours = _written(ds, name, mp_rank)
    native_dir = ds.path(_native(name))
    tag = (native_dir / "latest").read_text().strip()
    path = native_dir / tag / f"mp_rank_{mp_rank:02d}_model_states.pt"
    theirs = torch.load(path, map_location="cpu", weights_only=False)
    assert list(ours) == list(theirs)
    for key in ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments"):
        assert ours[key] is None and theirs[key] is None, key
    assert ours["dp_world_size"] == world_size // spec.get("tp", 1)
    assert ours["ds_config"]["zero_optimization"]["stage"] == 0
    assert (ours["mp_world_size"], ours["ds_config"].get("tensor_parallel")) == (
        theirs["mp_world_size"],
        theirs["ds_config"].get("tensor_parallel"),
    )
    trainable = [n for n in ours["module"] if n not in set(ours["buffer_names"])]
    assert trainable == list(theirs["module"])
    for n in trainable:
        mine, native = ours["module"][n], theirs["module"][n]
        assert (mine.dtype, mine.shape) == (native.dtype, native.shape), n
    ours_opt, theirs_opt = ours["optimizer"], theirs["optimizer"]
    assert list(ours_opt) == list(theirs_opt)
    inner = (lambda o: o) if spec["dtype"] == "fp32" else (lambda o: o["optimizer_state_dict"])
    for a, b in zip(inner(ours_opt)["state"].items(), inner(theirs_opt)["state"].items(), strict=True):
        assert a[0] == b[0] and list(a[1]) == list(b[1])
        assert all((a[1][k].dtype, a[1][k].shape) == (b[1][k].dtype, b[1][k].shape) for k in a[1])
    groups = [[g["params"] for g in inner(o)["param_groups"]] for o in (ours_opt, theirs_opt)]
    assert groups[0] == groups[1]
    if spec["dtype"] != "fp32":
        shapes = [[tuple(m.shape) for m in g] for g in ours_opt["fp32_groups"]]
        assert shapes == [[tuple(m.shape) for m in g] for g in theirs_opt["fp32_groups"]]
        src_dir = ds.path(source)
        src_tag = (src_dir / "latest").read_text().strip()
        optim_file = next((src_dir / src_tag).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        scaler = torch.load(optim_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]["loss_scaler"]
        assert ours_opt["cur_scale"] == scaler.cur_scale
        assert ours_opt["dynamic_loss_scale"] == (spec["dtype"] == "fp16")


@pytest.mark.parametrize("name", TO_STAGE0)
def test_the_stage0_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files (a stage-0 checkpoint index), the same whole model and optimizer state."""
    source, _, _ = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    after = ckptspec.open(out)
    assert after.kind == Kind.STAGE0
    # a stage-0 checkpoint's optimizer metadata records no loss scaler or clip_grad (FP16_UnfusedOptimizer's
    # loss scale is compared with the source's above)
    check_same_to_ckptspec(ckptspec.open(ds.path(source)), after, optimizer_keys=("class", "groups"))


# One more step after resuming, against the source job resumed at its own layout (ZeRO-2: the job that never
# stopped): each rank averages its share of the same 12-sample batch, in another reduction (stage 0's all-reduce,
# ZeRO-2's reduce-scatter) and, from 2 to 3 ranks, other shares; the bounds of tests/export/test_reshard.py.
STEP_TOLERANCE = {"bf16": 1e-3}


@pytest.mark.parametrize("case", sorted(STAGE0_RESHARD_CASES))
def test_a_stage0_job_holds_the_source_masters_and_steps_as_the_job_that_never_stopped(case, ds):
    """job/resume.py: the stage-0 job's fp32 masters after ``engine.load_checkpoint`` (FP16_UnfusedOptimizer's
    fp32_groups, or the fp32 module itself) equal the source job's live masters bit for bit, with its counters; one
    more step moves them as it moves the source job resumed at its own layout, within STEP_TOLERANCE."""
    source, _, _ = STAGE0_RESHARD_CASES[case]
    dtype = RESUME_SOURCE_SPECS[source][0]["dtype"]
    result = json.loads((ds.path(case) / "resume.json").read_text())
    assert result["loaded"] and result["reshard_error"] is None and result["error"] is None, result
    assert result["consistent"] and result["mismatched"] == [], result
    assert (result["global_steps"], result["skipped_steps"]) == (2, 0)
    resumed = torch.load(ds.path(case) / "after_step.pt", weights_only=True)
    never_stopped = torch.load(ds.path(f"native-{source}") / "after_step.pt", weights_only=True)
    before = torch.load(ds.path(source) / "live_fp32.pt", weights_only=True)
    assert resumed.keys() == never_stopped.keys() == before.keys() and before
    assert any(not torch.equal(never_stopped[n], before[n].float()) for n in before)  # the step moved them
    worst = max((resumed[n] - never_stopped[n]).abs().max().item() for n in never_stopped)
    assert worst <= STEP_TOLERANCE[dtype], worst


def test_deepspeeds_own_autotp_stage0_save_is_read_as_the_job_held_it(ds):
    """DeepSpeed's AutoTP job at stage 0 saves one model-states file per tensor rank, each its FP16_UnfusedOptimizer
    (``fp32_groups`` of its shards): valid from its files, one domain per tensor rank, and the whole masters ckptspec
    reads are the job's own on its tensor ranks (its oracle), put together, bit for bit."""
    entry = ds.path("tp2-s0-bf16-ws2")
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.STAGE0 and [d.coordinate.tensor for d in opened.domains] == [0, 1]
    shapes = {n: tuple(shape) for n, shape in info(entry)["global_shapes"].items()}
    oracles = rank_oracles(entry)
    assert {o["master_source"][n] for o in oracles for n in o["masters"]} == {HELD_BY["bf16"]}
    masters, read = merged(oracles, lambda o: o["masters"], shapes), opened.state_dict()
    assert masters.keys() == read.keys() and any(masters[n].shape != oracles[0]["masters"][n].shape for n in masters)
    for n, master in masters.items():
        assert _equal(read[n], master), n


def _refused(args, tmp_path) -> str:
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reshard", *map(str, args[:1]), str(out), *map(str, args[1:])])
    assert result.exit_code == 1 and "CK410" in result.output, result.output
    assert not out.exists() or not any(out.iterdir())
    return result.output


def test_a_tie_beside_a_frozen_layer_a_stage0_file_could_not_tell_apart_is_refused_by_name(committed, tmp_path):
    """The committed source has a tie (written for a stage-0 job as one tensor under both names:
    test_reshard_stage0_ties.py) and a frozen layer whose bias has l2.bias's shape, [16]: a stage-0 file's masters are
    matched to the module's parameters by shape, in order, which could not tell them apart. CK410, nothing written."""
    output = _refused([committed("s2-bf16-ws2"), "--world-size", "2", "--stage", "0"], tmp_path)
    assert "frozen parameters (frozen.weight, frozen.bias) that a stage-0 file could not tell" in output


def test_ties_of_an_autotp_checkpoint_for_a_stage0_job_are_refused_by_name(ds, tmp_path):
    """The AutoTP MLP whose two Linear layers share one weight: for a stage-0 job, at its tensor degree or merged, not
    written yet (CK410 naming the tie; a data-parallel checkpoint's tie is written), nothing written."""
    source = ds.path("tp2-s1-fp32-ws2-tied")
    for i, degree in enumerate(([], ["--tensor-parallel", "1"])):
        (tmp_path / str(i)).mkdir()
        output = _refused([source, "--world-size", "2", "--stage", "0", *degree], tmp_path / str(i))
        assert "tied parameters (" in output and "of a tensor-, pipeline- or expert-parallel checkpoint" in output


@pytest.mark.parametrize("source", ["tp2-s2-bf16-ws2-extras", "tp2-s3-bf16-ws2-extras"])
def test_frozen_parameters_of_an_autotp_source_merged_or_split_for_stage0_are_checked(
    source, ds, tmp_path, monkeypatch
):
    """An AutoTP ZeRO-2/3 source with a frozen weight AutoTP splits, a frozen bias it leaves whole and buffers, merged
    or split for a stage-0 job (written: above, from ZeRO-2): each written file's masters are named by their shapes in
    module order, so the writer checks that this names the trainable parameters alone
    (``reshard_stage0.refuse_untold_frozen``), refusing by name (CK410) before anything is written where it would not
    (here made so: no choice named)."""
    monkeypatch.setattr("ckptspec.export.reshard_stage0.named_by_shapes", lambda held, dense: None)
    for i, degree in enumerate((["--tensor-parallel", "1"], ["--tensor-parallel", "4"])):
        (tmp_path / str(i)).mkdir()
        output = _refused([ds.path(source), "--world-size", "4", "--stage", "0", *degree], tmp_path / str(i))
        assert "frozen parameters (blocks.0.up.weight, head.bias) that a stage-0 file could not tell" in output


def _frozen_source(ds):
    """The ZeRO-2 bf16 source with frozen parameters: its manifest, rank 0's optimizer state, its module order."""
    source = ds.path("dense-s2-bf16-ws2-frozen")
    found, states = validated_source(source, None, None)
    plan = plan_reconstruction(source, found, states=states)
    return found, source_osd(found, plan, states), module_order(found, plan, states)


def test_frozen_parameters_a_stage0_file_could_not_tell_apart_are_refused_by_name(ds):
    """One rule (reshard_stage0.refuse_untold_frozen): a stage-0 file's masters name no parameter, and its reader
    matches them to the module's parameters by shape, in order (layout/stage0_names.frozen_apart). As saved the one such
    choice is the trainable parameters: written. A module order where a frozen parameter could take a master's place
    (head.bias first: its shape, [5], is no master's, but blocks.0.up.weight moved after blocks.1.up.weight is [32, 16]
    as that master is): refused (CK410) before anything is written. An fp32 job's module is its masters: its reader
    takes the shapes of the torch optimizer's per-element state (layout/stage0_names.client_moments), so written where
    the source keeps such a state of every group, refused where it keeps none."""
    found, osd, order = _frozen_source(ds)
    refuse_stage0(found, osd, order)  # as saved: written
    assert [f.name for f in found.frozen] == ["blocks.0.up.weight", "head.bias"]
    moved = [n for n in order if n != "blocks.0.up.weight"]
    moved.insert(moved.index("blocks.1.up.weight") + 1, "blocks.0.up.weight")
    with pytest.raises(ReshardUnsupported, match="could not tell from the trainable ones") as refused:
        refuse_stage0(found, osd, moved)
    assert refused.value.code == "CK410"
    fp32 = found.model_copy(deep=True)
    fp32.layout.model_dtype = "float32"
    refuse_stage0(fp32, osd, order)  # written: the moments' shapes name the trainable parameters
    for f in fp32.files:
        f.state_partitions = None  # an optimizer without per-element state (SGD without momentum)
    with pytest.raises(ReshardUnsupported, match="whose optimizer keeps no per-element state of group 0") as refused:
        refuse_stage0(fp32, osd, order)
    assert refused.value.code == "CK410"
    with pytest.raises(ReshardUnsupported, match="of a tensor-, pipeline- or expert-parallel checkpoint"):
        refuse_stage0(found, osd)  # no module order: a model-parallel writer's call


def test_fused_adam_is_refused_by_name(ds):
    """DeepSpeed's FusedAdam (FP16_Optimizer at stage 0: flat fp32 groups, a step per group): CK410 naming it, from
    the source's optimizer hyperparameters (``bias_correction``, which torch's Adam has not)."""
    source = ds.path("dense-s2-bf16-ws2")
    found, states = validated_source(source, None, None)
    osd = source_osd(found, plan_reconstruction(source, found, states=states), states)
    refuse_stage0(found, osd)  # as saved: written
    fused = found.model_copy(deep=True)
    fused.optimizer.groups[0].hyperparameters["bias_correction"] = True
    with pytest.raises(ReshardUnsupported, match="FusedAdam"):
        refuse_stage0(fused, osd)
