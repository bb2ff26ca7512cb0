"""``ckptspec reconstruct DCP_DIR OUT`` (issue #42): the model weights of a real FSDP2 save as one safetensors file,
equal bit for bit to the saving job's ``full_tensor()`` (tests/_harness/dcp_save_job.py's oracles) and to torch's own
``dcp_to_torch_save``; a checkpoint with errors writes nothing."""

from __future__ import annotations

import io
import json
import pickle
import shutil

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name

from ckptspec.checkpoint.dcp.metadata import Chunk
from ckptspec.export.dcp_input import runs


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
def test_reconstruct_equals_the_job_and_torch(world_size, save, ds, tmp_path):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    entry = ds.path(dcp_save_name(world_size))
    result = _run("reconstruct", entry / save, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.output == f"{tmp_path / 'out'}: wrote 10 tensors (0.0 MiB) to model.safetensors\n"
    got = load_file(tmp_path / "out" / "model.safetensors")

    oracle = torch.load(entry / "oracle.pt", weights_only=True)["params" if save == "dcp" else "params2"]
    dcp_to_torch_save(str(entry / save), str(tmp_path / "torch.pt"))
    theirs = torch.load(tmp_path / "torch.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(oracle) == sorted(theirs)
    for name, tensor in got.items():
        assert tensor.dtype == oracle[name].dtype and torch.equal(tensor, oracle[name]), name
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_a_checkpoint_with_errors_writes_nothing(ds, tmp_path):
    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    (directory / "__1_0.distcp").unlink()
    result = _run("reconstruct", directory, tmp_path / "out")
    assert result.exit_code == 1
    assert "CK252 __1_0.distcp is missing" in result.output
    assert f"{directory}: not reconstructed: the checkpoint has errors; nothing was written" in result.output
    assert not (tmp_path / "out").exists()


def test_options_of_a_zero_checkpoint_are_refused(ds, tmp_path):
    result = _run("reconstruct", ds.path(dcp_save_name(1)) / "dcp", tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 2
    assert "--dtype other than fp32: not for a DCP checkpoint (.metadata) yet" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
def test_optimizer_state_equals_the_job(world_size, save, ds, tmp_path):
    """--optimizer-state: every Adam moment equal bit for bit to the FSDP2 job's full_tensor() of it, each group's
    step the job's, the hyperparameters torch's consolidation's (docs/reconstruct.md's metadata keys)."""
    import torch
    from safetensors import safe_open

    entry = ds.path(dcp_save_name(world_size))
    result = _run("reconstruct", entry / save, tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 0, result.output
    assert result.output.endswith("wrote 20 tensors (0.0 MiB) to model.safetensors, optimizer.safetensors\n")
    oracle = torch.load(entry / "oracle.pt", weights_only=True)["state" if save == "dcp" else "state2"]
    groups = torch.load(entry / "torch_save.pt", weights_only=True)["optim"]["param_groups"]
    with safe_open(tmp_path / "out" / "optimizer.safetensors", "pt") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}
        meta = f.metadata()
    assert sorted(got) == sorted(f"{p}.{k}" for p, st in oracle.items() for k in st if k != "step")
    for param, states in oracle.items():
        for key, tensor in states.items():
            if key != "step":
                mine = got[f"{param}.{key}"]
                assert mine.dtype == tensor.dtype and torch.equal(mine, tensor), f"{param}.{key}"
    group_of = json.loads(meta["ckptspec.optimizer_groups"])
    assert group_of == {p: g for g, group in enumerate(groups) for p in group["params"]}
    assert json.loads(meta["ckptspec.states"]) == {
        p: {k: f"{p}.{k}" for k in st if k != "step"} for p, st in oracle.items()
    }
    optimizer = json.loads(meta["ckptspec.optimizer"])
    assert optimizer["class"] == "unknown" and json.loads(meta["ckptspec.aliases"]) == {}
    for g, group in enumerate(optimizer["groups"]):
        assert group["optimizer_group"] == g
        assert {oracle[p]["step"].item() for p, gg in group_of.items() if gg == g} == {group["step"]}
        want = {k: list(v) if isinstance(v, tuple) else v for k, v in groups[g].items() if v is not None}
        assert group["hyperparameters"] == {k: v for k, v in want.items() if k != "params"}


def test_optimizer_state_refused_before_writing(ds, tmp_path):
    """A save without optimizer state (its optim.state entries and items dropped from the .metadata) is refused
    by name (CK402); so are a step that differs within a param group (CK401): nothing is written."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    original = (directory / ".metadata").read_bytes()
    metadata = FileSystemReader(str(directory)).read_metadata()
    for fqn in [k for k in metadata.state_dict_metadata if k.startswith("optim.state.")]:
        del metadata.state_dict_metadata[fqn]
    for key in [k for k in metadata.storage_data if k.fqn.startswith("optim.state.")]:
        del metadata.storage_data[key]
    metadata.storage_meta = None
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    result = _run("reconstruct", directory, tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 1, result.output
    assert "CK402 no optimizer state: no tensor entry's name starts with 'optim.state.'" in result.output
    assert not (tmp_path / "out").exists()

    (directory / ".metadata").write_bytes(original)
    record = io.BytesIO()
    torch.save(torch.tensor(7.0), record)  # l1.weight's step: 7, its group's others 1
    f = directory / "__1_0.distcp"
    start = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(record.getvalue())
    metadata = FileSystemReader(str(directory)).read_metadata()
    step = next(k for k in metadata.storage_data if k.fqn == "optim.state.l1.weight.step")
    metadata.storage_data[step] = type(metadata.storage_data[step])(f.name, start, len(record.getvalue()))
    metadata.storage_meta = None
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    result = _run("reconstruct", directory, tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 1, result.output
    assert "CK401 param group 0: its parameters' steps differ" in result.output
    assert not (tmp_path / "out").exists()


def test_runs_of_a_chunk_split_on_an_inner_dimension():
    """FSDP2 splits dim 0 (one run a chunk); any other box is a run per row of its outer dimensions."""
    assert list(runs((4, 6), Chunk((1, 2), (2, 3)))) == [(0, 8, 3), (3, 14, 3)]
    assert list(runs((4, 6), Chunk((2, 0), (2, 6)))) == [(0, 12, 12)]
    assert list(runs((), Chunk((), ()))) == [(0, 0, 1)]
    assert list(runs((2, 3, 4), Chunk((0, 1, 0), (2, 2, 4)))) == [(0, 4, 8), (8, 16, 8)]
