"""#40: ``ckptspec reshard`` of a DeepSpeed ``BF16_Optimizer`` checkpoint (bf16 with ``data_types.grad_accum_dtype:
fp32`` at ZeRO stage 1, the configuration of BLOOM's and Megatron-DeepSpeed's runs): export/reshard_layout.py and
export/reshard_bf16.py.

The real-job ground truth is in test_reshard.py (RESHARD_CASES ``reshard-s1-bf16opt-*``: the same job config at 3
ranks, a plain ZeRO-2 job at 3 and a ZeRO-3 job at 2 load the output with ``engine.load_checkpoint`` and hold the
source's masters, moments, step, frozen parameters, buffers and tie bit for bit; one more step against the source
resumed at its own layout) and test_universal.py (``export-universal`` against ``ds_to_universal``). Here: the files
themselves, against the source's and against DeepSpeed's own ZeRO saves.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.faults import tag_dir
from click.testing import CliRunner

from ckptspec.checkpoint.embedded import CLIENT_STATE_KEY
from ckptspec.cli import cli

SOURCE = "s1-bf16-ws2-bf16opt"


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _same(a, b, where: str) -> None:
    """``a`` is ``b``: the same types, keys in the same order, values, tensors bit for bit."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert repr(a) == repr(b), (where, a, b)


@pytest.mark.parametrize("through", [3, 1])
def test_there_and_back_gives_the_source_files(ds, tmp_path, through):
    """2 -> N -> 2 ranks: every file, key and value of DeepSpeed's own save (its partitions whole, the tail padding
    on the last rank, ``group_paddings`` there only), bit for bit; only the embedded manifest is added."""
    source = tag_dir(ds.path(SOURCE))
    there, back = tmp_path / "there", tmp_path / "back"
    result = _run("reshard", ds.path(SOURCE), there, "--world-size", through)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tag_dir(there).glob("bf16_zero_pp_rank_*")) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(through)
    ]
    assert _run("reshard", there, back, "--world-size", 2).exit_code == 0
    for path in sorted(source.iterdir()):
        ours = _load(tag_dir(back) / path.name)
        ours.pop(CLIENT_STATE_KEY, None)
        _same(ours, _load(path), path.name)


def test_a_stage1_target_is_bf16_optimizers_layout(ds, tmp_path):
    """At 3 ranks: BF16_Optimizer's keys, each rank's fp32 partition and moments whole (1905 elements padded to 1908,
    636 a rank), the padding recorded on the last rank only, the model states at 3 ranks."""
    out = tmp_path / "out"
    assert _run("reshard", ds.path(SOURCE), out, "--world-size", 3).exit_code == 0
    source = _load(next(tag_dir(ds.path(SOURCE)).glob("bf16_zero_pp_rank_0_*")))["optimizer_state_dict"]
    for rank in range(3):
        osd = _load(tag_dir(out) / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert list(osd) == list(source)  # BF16_Optimizer.state_dict()'s keys: no loss scaler, no zero_stage
        assert [t.numel() for t in osd["single_partition_of_fp32_groups"]] == [636]
        assert {k: v.numel() for k, v in osd["base_optimizer_state"]["state"][0].items()} == {
            "step": 1,
            "exp_avg": 636,
            "exp_avg_sq": 636,
        }
        assert osd["group_paddings"] == [3 if rank == 2 else 0] and osd["partition_count"] == [3]
        assert osd["clip_grad"] == source["clip_grad"] and osd["ds_version"] == source["ds_version"]
    model = _load(tag_dir(out) / "mp_rank_00_model_states.pt")
    assert model["dp_world_size"] == 3 and model["optimizer"] is None
    assert model["ds_config"]["data_types"] == {"grad_accum_dtype": "fp32"}


@pytest.mark.parametrize(("stage", "native"), [(2, "s2-bf16-ws2"), (3, "s3-bf16-ws2-sub")])
def test_a_zero_target_has_deepspeeds_zero_entries(ds, tmp_path, stage, native):
    """--stage 2|3: the optimizer-state file a bf16 ZeRO job saves (DeepSpeed's own save of that stage: the same keys
    in the same order, its static loss scaler of scale 1), the fp32 partitions without the tail padding."""
    out = tmp_path / "out"
    result = _run("reshard", ds.path(SOURCE), out, "--world-size", 2, "--stage", stage)
    assert result.exit_code == 0, result.output
    theirs = _load(next(tag_dir(ds.path(native)).glob("bf16_zero_pp_rank_0_*")))["optimizer_state_dict"]
    ours = _load(tag_dir(out) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert list(ours) == list(theirs)
    assert vars(ours["loss_scaler"]) == vars(theirs["loss_scaler"]) and ours["loss_scaler"].cur_scale == 1.0
    assert int(ours["zero_stage"]) == stage and ours["dynamic_loss_scale"] is False
    if stage == 2:
        last = _load(tag_dir(out) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert [t.numel() for t in last["single_partition_of_fp32_groups"]] == [954 - 3]  # the padding dropped


def test_a_stage0_target_is_refused_by_name_before_writing(ds, tmp_path):
    result = _run("reshard", ds.path(SOURCE), tmp_path / "out", "--world-size", 2, "--stage", 0)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and "BF16_Optimizer" in result.output and "grad_accum_dtype" in result.output
    assert list(tmp_path.iterdir()) == []


PIPELINE = "pp2-s1-bf16-ws2-bf16opt"  # BF16_Optimizer per stage (Megatron-DeepSpeed's configuration)


def test_a_pipelines_stages_are_bf16_optimizers_at_the_target_data_degree(ds):
    """pp2 x dp1 -> pp2 x dp2 (PARALLEL_RESHARDS, loaded by a real pp2 x dp2 job: test_reshard_parallel.py): each
    stage's files are BF16_Optimizer's at 2 data ranks: its keys, every partition and its moments whole (the stage's
    elements padded to a multiple of 4, halved), the padding recorded on the last data rank only."""
    out = tag_dir(ds.path(f"{PIPELINE}>ws4") / "resharded")
    for stage in range(2):
        source = _load(tag_dir(ds.path(PIPELINE)) / f"bf16_zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")
        source = source["optimizer_state_dict"]
        numel = source["single_partition_of_fp32_groups"][0].numel() - source["group_paddings"][0]
        padded = -(-numel // 4) * 4
        for rank in range(2):
            osd = _load(out / f"bf16_zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt")["optimizer_state_dict"]
            assert list(osd) == list(source) and "loss_scaler" not in osd
            (master,) = osd["single_partition_of_fp32_groups"]
            state = osd["base_optimizer_state"]["state"][0]
            assert master.numel() == state["exp_avg"].numel() == state["exp_avg_sq"].numel() == padded // 2
            assert osd["partition_count"] == [2]
            assert osd["group_paddings"] == [padded - numel if rank == 1 else 0], (stage, rank, osd["group_paddings"])


def test_a_pipeline_at_its_own_layout_is_deepspeeds_save(ds, tmp_path):
    source = tag_dir(ds.path(PIPELINE))
    result = _run("reshard", ds.path(PIPELINE), tmp_path / "out", "--world-size", 2)
    assert result.exit_code == 0, result.output
    for path in sorted(source.iterdir()):
        _same(_load(tag_dir(tmp_path / "out") / path.name), _load(path), path.name)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--world-size", 2, "--stage", 0], "--stage 0"),
        (["--world-size", 2, "--pipeline-parallel", 1], "--pipeline-parallel 1"),
    ],
)
def test_a_pipeline_moved_otherwise_is_refused_by_name_before_writing(ds, tmp_path, args, named):
    result = _run("reshard", ds.path(PIPELINE), tmp_path / "out", *args)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and "BF16_Optimizer" in result.output and f"not with {named}" in result.output
    assert list(tmp_path.iterdir()) == []


# --grad-accum-dtype: the target job's data_types.grad_accum_dtype, which picks a stage-1 bf16 job's optimizer. The
# real-job ground truth is test_reshard.py's (RESHARD_JOB_CASES "reshard-*-to-*bf16opt-*", "reshard-s1-bf16opt-to-s1-*":
# BF16_Optimizer jobs load bf16 ZeRO-1/2/3 sources, a plain ZeRO-1 job the BF16_Optimizer one). Here: the files.
ZERO1 = "s1-bf16-ws2"  # the same job config as SOURCE's but data_types


PIPE_ZERO1 = "pp2-s1-bf16-ws2"  # PIPELINE's job config but data_types: a ZeRO-1 pipeline


@pytest.mark.parametrize(
    ("start", "there", "back", "through"),
    [
        (ZERO1, "fp32", "bf16", 3),
        (SOURCE, "bf16", "fp32", 3),
        (PIPE_ZERO1, "fp32", "bf16", 4),
        (PIPELINE, "bf16", "fp32", 4),
    ],
)
def test_the_other_kind_and_back_gives_the_source_files(ds, tmp_path, start, there, back, through):
    """2 ranks -> ``through`` of the other kind -> 2 of the source's (a pipeline's: pp2 x dp1 -> pp2 x dp2 -> pp2 x
    dp1): every file, key and value of DeepSpeed's own save, its ds_config included, bit for bit; only the manifest
    is added (embedded, and beside them)."""
    source = tag_dir(ds.path(start))
    other, again = tmp_path / "other", tmp_path / "again"
    result = _run("reshard", ds.path(start), other, "--world-size", through, "--grad-accum-dtype", there)
    assert result.exit_code == 0, result.output
    result = _run("reshard", other, again, "--world-size", 2, "--grad-accum-dtype", back)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tag_dir(again).glob("*.pt")) == sorted(p.name for p in source.iterdir())
    for path in sorted(source.iterdir()):
        ours = _load(tag_dir(again) / path.name)
        ours.pop(CLIENT_STATE_KEY, None)
        _same(ours, _load(path), path.name)


def _structure(value):
    """``value`` with each tensor as its dtype and shape: keys in order, every other value as saved (its repr)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    if isinstance(value, dict):
        return type(value).__name__, [(k, _structure(v)) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return type(value).__name__, [_structure(v) for v in value]
    return repr(value)


# ZeRO-2 saves the frozen parameters' shapes and fragments, which a stage-1 job does not: kept from the source, as
# every stage-2 source written at stage 1 keeps them (DeepSpeed's load reads the module)
_STAGE2_ONLY = ("frozen_param_shapes", "frozen_param_fragments")


@pytest.mark.parametrize(
    ("start", "args", "native"),
    [
        (ZERO1, ["--grad-accum-dtype", "fp32"], SOURCE),
        ("s2-bf16-ws2", ["--stage", 1, "--grad-accum-dtype", "fp32"], SOURCE),
        (SOURCE, ["--grad-accum-dtype", "bf16"], ZERO1),
        (PIPE_ZERO1, ["--grad-accum-dtype", "fp32"], PIPELINE),
        (PIPELINE, ["--grad-accum-dtype", "bf16"], PIPE_ZERO1),
    ],
)
def test_the_other_kind_is_deepspeeds_own_save_of_it(ds, tmp_path, start, args, native):
    """At 2 ranks, every file is what DeepSpeed saves for a job of the target's kind (``native``: the same model and
    config but data_types, trained the same steps): the same files and keys in the same order, the same scalars and
    ds_config, every tensor of the same dtype and shape (BF16_Optimizer: no loss scaler, no stage, each partition
    whole); only the values of the masters, moments and weights differ (another training)."""
    out = tmp_path / "out"
    result = _run("reshard", ds.path(start), out, "--world-size", 2, *args)
    assert result.exit_code == 0, result.output
    theirs = tag_dir(ds.path(native))
    assert sorted(p.name for p in tag_dir(out).glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for path in sorted(theirs.glob("*.pt")):
        ours, native_doc = _load(tag_dir(out) / path.name), _load(path)
        ours.pop(CLIENT_STATE_KEY, None)
        if start == "s2-bf16-ws2":  # its job's config is another (no bucket sizes): the source's, at stage 1
            config = _load(tag_dir(ds.path(start)) / "mp_rank_00_model_states.pt")["ds_config"]
            native_doc["ds_config"] = {
                **config,
                "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"},
            }
            if "module" in native_doc:
                for key in _STAGE2_ONLY:
                    assert ours.pop(key) is not None and native_doc.pop(key) is None, key
        assert _structure(ours) == _structure(native_doc), path.name


def test_an_aligned_source_is_written_in_bf16_optimizers_layout(ds, tmp_path):
    """parameter_alignment (ZeRO-2 with its gaps): BF16_Optimizer runs none, so the target has no gap, and its
    ds_config no parameter_alignment (by which ckptspec reads the layout; the output is validated so)."""
    out = tmp_path / "out"
    result = _run(
        "reshard", ds.path("s2-bf16-ws2-align"), out, "--world-size", 3, "--stage", 1, "--grad-accum-dtype", "fp32"
    )
    assert result.exit_code == 0, result.output
    source_config = _load(tag_dir(ds.path("s2-bf16-ws2-align")) / "mp_rank_00_model_states.pt")["ds_config"]
    assert source_config["zero_optimization"]["parameter_alignment"] is True
    model = _load(tag_dir(out) / "mp_rank_00_model_states.pt")
    assert "parameter_alignment" not in model["ds_config"]["zero_optimization"]
    assert model["ds_config"]["data_types"] == {"grad_accum_dtype": "fp32"}
    layout = json.loads((tag_dir(out) / "ckptspec.json").read_text())["layout"]
    assert (
        layout["optimizer"] == "BF16_Optimizer" and layout["tail_padding_saved"] and not layout["parameter_alignment"]
    )
    for rank in range(3):
        osd = _load(tag_dir(out) / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert "param_alignment_paddings" not in osd and [
            t.numel() for t in osd["single_partition_of_fp32_groups"]
        ] == [636]


def test_fp32_accumulation_at_stage_2_is_deepspeeds_zero_optimizer(ds, tmp_path):
    """At stage 2 DeepSpeed runs its ZeRO optimizer whatever data_types says: the files of ``--stage 2`` alone."""
    plain, fp32 = tmp_path / "plain", tmp_path / "fp32"
    assert _run("reshard", ds.path(ZERO1), plain, "--world-size", 3, "--stage", 2).exit_code == 0
    result = _run("reshard", ds.path(ZERO1), fp32, "--world-size", 3, "--stage", 2, "--grad-accum-dtype", "fp32")
    assert result.exit_code == 0, result.output
    for path in sorted(tag_dir(plain).iterdir()):
        assert (tag_dir(fp32) / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize(
    ("source", "args", "named"),
    [
        ("s1-fp32-ws3-rr", ["--grad-accum-dtype", "fp32"], "--grad-accum-dtype fp32 of a float32 checkpoint"),
        ("s1-fp16-ws2", ["--grad-accum-dtype", "bf16"], "--grad-accum-dtype bf16 of a float16 checkpoint"),
        (ZERO1, ["--stage", 0, "--grad-accum-dtype", "fp32"], "--grad-accum-dtype fp32 with a stage-0 target"),
        (ZERO1, ["--tensor-parallel", 2, "--grad-accum-dtype", "fp32"], "not with a --tensor-parallel split"),
        ("tp2pp2-s1-bf16-ws4", ["--grad-accum-dtype", "fp32"], "only so far, not with tensor degree 2"),
        ("pp2-s0-bf16-ws2", ["--grad-accum-dtype", "bf16"], "only so far, not with a stage-0 source"),
        (PIPE_ZERO1, ["--grad-accum-dtype", "fp32", "--pipeline-parallel", 1], "not with --pipeline-parallel 1"),
    ],
)
def test_a_grad_accum_dtype_the_target_cannot_express_is_refused_by_name_before_writing(
    ds, tmp_path, source, args, named
):
    result = _run("reshard", ds.path(source), tmp_path / "out", "--world-size", 2, *args)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and named in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_the_api_refuses_a_dtype_it_does_not_write_for(ds, tmp_path):
    import ckptspec

    with pytest.raises(ckptspec.CkptspecError) as raised:
        ckptspec.reshard(ds.path(ZERO1), tmp_path / "out", 2, grad_accum_dtype="float16")
    assert raised.value.code == "CK410" and "--grad-accum-dtype fp16" not in raised.value.message
    assert "float16: not a gradient accumulation dtype" in raised.value.message
    assert list(tmp_path.iterdir()) == []
