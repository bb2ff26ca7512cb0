"""``ckptspec reshard DCP_DIR OUT --to deepspeed --world-size N --stage 1|2|3`` (issue #42): what it writes is a valid
ZeRO checkpoint, each model tensor described as what it is (trained, frozen, a tie, a buffer); what a DeepSpeed ZeRO
fp32 target cannot hold is refused by name (CK410) before anything is written, and a
hyperparameter item that is not a plain value is refused without running it. A DeepSpeed job's load of the output:
tests/dcp/test_dcp_reshard.py."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil

import pytest
from _harness.scenarios import dcp_save_name


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize(
    ("world_size", "stage", "dtype"), [(3, 1, "fp32"), (1, 2, "fp32"), (4, 3, "fp32"), (2, 3, "bf16")]
)
def test_the_output_is_a_valid_zero_checkpoint(world_size, stage, dtype, ds, tmp_path):
    from ckptspec.deepspeed.check.zero import validate_checkpoint

    out = tmp_path / "out"
    given = ("--world-size", world_size, "--stage", stage, "--to", "deepspeed", "--model-dtype", dtype)
    result = _run("reshard", ds.path(dcp_save_name(2)) / "dcp", out, *given)
    assert result.exit_code == 0, result.output
    assert f"global_step1 resharded from 2 to {world_size} ranks (ZeRO stage {stage})" in result.output
    names = sorted(p.name for p in (out / "global_step1").iterdir() if p.suffix == ".pt")
    ranks, prefix = range(world_size), "bf16_" if dtype == "bf16" else ""
    optim = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks]
    if stage == 3:
        assert names == sorted(optim + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks])
    else:
        assert names == sorted(["mp_rank_00_model_states.pt", *optim])
    manifest, findings = validate_checkpoint(out, verify_digests=True)
    assert manifest is not None and not [f for f in findings if f.severity == "error"]
    assert (manifest.layout.zero_stage, manifest.layout.world_size) == (stage, world_size)
    assert (manifest.layout.model_dtype, manifest.layout.master_dtype) == (_DTYPES[dtype], "float32")
    assert [g.step for g in manifest.optimizer.groups] == [1.0, 1.0]


_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.mark.parametrize(("saved", "stage"), [(2, 1), (3, 2), (3, 3), (1, 2)])
def test_frozen_parameters_ties_and_buffers_are_told_apart(saved, stage, ds, tmp_path):
    """FSDP shards parameters, never buffers, and a tie's second name holds its owner's bytes: the output describes
    (and DeepSpeed's model states list) each as a DeepSpeed job of the model saves it. A save of one rank holds every
    entry whole: its frozen parameters read as buffers (the tie is still found)."""
    import torch

    from ckptspec.deepspeed.check.zero import validate_checkpoint

    out = tmp_path / "out"
    result = _run("reshard", ds.path(dcp_save_name(saved)) / "dcp", out, "--world-size", "2", "--stage", stage)
    assert result.exit_code == 0, result.output
    manifest, _ = validate_checkpoint(out)
    frozen = ["frozen.weight", "frozen.bias"] if saved > 1 else []
    buffers = ["step_count", "running"] + ([] if saved > 1 else ["frozen.weight", "frozen.bias"])
    assert [f.name for f in manifest.frozen] == frozen
    assert sorted(b.name for b in manifest.buffers) == sorted(buffers)
    assert [(a.name, a.owner) for a in manifest.aliases] == [("head.weight", "emb.weight")]
    model = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    states = torch.load(out / "global_step1" / model, weights_only=False)
    assert sorted(states["buffer_names"]) == sorted(buffers)
    assert states["shared_params"] == {"head.weight": "emb.weight"}
    assert list(states["frozen_param_shapes"] or {}) == (frozen if stage > 1 else [])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ((), "no --stage for a DCP checkpoint"),
        (("--stage", "0"), "--stage 0 for a DCP checkpoint"),
        (("--stage", "2", "--tensor-parallel", "2"), "--tensor-parallel: not for a DCP checkpoint"),
        (("--stage", "2", "--sub-group-size", "8"), "--sub-group-size: a stage-3 option, not for --stage 2"),
        (("--stage", "2", "--to", "fsdp"), "--to fsdp: reshard writes DeepSpeed checkpoints only"),
        (("--stage", "2", "--model-dtype", "fp16"), "a float16 target job (--model-dtype): fp32 and bf16 ones"),
    ],
)
def test_what_is_not_written_is_refused_by_name(options, named, ds, tmp_path):
    result = _run("reshard", ds.path(dcp_save_name(2)) / "dcp", tmp_path / "out", "--world-size", "2", *options)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and named in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_zero3_target_of_a_save_of_one_rank_is_refused_by_name(ds, tmp_path):
    """One rank saves every entry whole: its frozen parameters cannot be told from buffers, which ZeRO-3 keeps apart."""
    out = tmp_path / "out"
    result = _run("reshard", ds.path(dcp_save_name(1)) / "dcp", out, "--world-size", "2", "--stage", "3")
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and "step_count, running, frozen.weight, frozen.bias: saved whole" in result.output
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (("--to", "fsdp"), "--to fsdp: reshard writes DeepSpeed checkpoints only"),
        (("--model-dtype", "bf16"), "--model-dtype: for a DCP checkpoint only"),
    ],
)
def test_a_deepspeed_source_refuses_the_dcp_options_by_name(options, named, committed, tmp_path):
    result = _run("reshard", committed("s2-bf16-ws2"), tmp_path / "out", "--world-size", "2", *options)
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and named in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_hyperparameter_that_is_not_a_plain_value_is_refused_and_never_run(ds, tmp_path):
    """``optim.param_groups.0.lr`` pointed at a torch.save of an object whose unpickling runs a command."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    metadata = FileSystemReader(str(directory)).read_metadata()
    key = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[key]
    forged = io.BytesIO()
    torch.save(_Payload(tmp_path / "ran"), forged)
    path = directory / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(forged.getvalue())
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(forged.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))

    result = _run("reshard", directory, tmp_path / "out", "--world-size", "2", "--stage", "2")
    assert result.exit_code == 1, result.output
    # the checks refuse it first (CK204, as validate does); the reshard's own reader would too (CK410)
    assert "CK204" in result.output and "optim.param_groups.0.lr" in result.output, result.output
    assert "posix.system" in result.output, result.output
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _single_process_save(directory, *, amsgrad=False, dtype=None, steps=((True, True),)):
    """A DCP save of a Linear and its AdamW by torch's own writer in one process (``no_dist``): ``steps`` says, per
    step, whether the weight and the bias get a gradient."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    if dtype is not None:
        model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=amsgrad)
    for weight, bias in steps:
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(2, 4, dtype=model.weight.dtype)).sum().backward()
        if not weight:
            model.weight.grad = None
        if not bias:
            model.bias.grad = None
        optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), no_dist=True)


@pytest.mark.parametrize(
    ("save", "named"),
    [
        ({"amsgrad": True}, "optim.state.weight.max_exp_avg_sq: a state besides exp_avg, exp_avg_sq and step"),
        ({"dtype": "bfloat16"}, "model.weight: bfloat16 [3, 4]: DeepSpeed's ZeRO master is fp32"),
        ({"steps": ((True, True), (True, False))}, "param group 0: its parameters' steps differ ([1.0, 2.0])"),
        ({"steps": ((True, False),)}, "bias: a trained parameter without optimizer state"),
    ],
)
def test_what_a_zero_adamw_file_cannot_hold_is_refused_by_name(save, named, tmp_path):
    import torch

    if "dtype" in save:
        save = {**save, "dtype": getattr(torch, save["dtype"])}
    _single_process_save(tmp_path / "dcp", **save)
    result = _run("reshard", tmp_path / "dcp", tmp_path / "out", "--world-size", "2", "--stage", "2")
    assert result.exit_code == 1, result.output
    assert "CK410" in result.output and named in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_single_process_save_is_written(tmp_path):
    _single_process_save(tmp_path / "dcp")
    result = _run("reshard", tmp_path / "dcp", tmp_path / "out", "--world-size", "3", "--stage", "1")
    assert result.exit_code == 0, result.output
    assert "global_step1 resharded from 1 to 3 ranks (ZeRO stage 1)" in result.output


def test_a_tie_is_told_from_a_frozen_parameter_of_the_same_shape(tmp_path):
    """torch's own single-process save of a model whose ``b.weight`` is ``a.weight`` (a tie) and whose ``c`` is a
    frozen Linear of the same shape: only the tie, whose bytes are its owner's, is written as an alias."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptspec.deepspeed.check.zero import validate_checkpoint

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({k: torch.nn.Linear(4, 4, bias=False) for k in "abc"})
    model["b"].weight = model["a"].weight
    model["c"].requires_grad_(False)
    optimizer = torch.optim.AdamW([model["a"].weight])
    (model["a"](torch.ones(2, 4)) + model["c"](torch.ones(2, 4))).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = _run("reshard", tmp_path / "dcp", tmp_path / "out", "--world-size", "2", "--stage", "2")
    assert result.exit_code == 0, result.output
    manifest, _ = validate_checkpoint(tmp_path / "out")
    assert [(a.name, a.owner) for a in manifest.aliases] == [("b.weight", "a.weight")]
    assert [b.name for b in manifest.buffers] == ["c.weight"]  # one rank: frozen and buffers alike (see above)
