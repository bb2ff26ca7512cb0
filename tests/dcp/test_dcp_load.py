"""``ckptspec.load_state_dict(DCP_DIR)`` (issue #42): the model state of a real FSDP2 save in memory, equal bit for bit
to the saving job's ``full_tensor()`` (tests/_harness/dcp_save_job.py's oracles), as torch tensors and numpy arrays;
``dtype`` casts the floating tensors only; a checkpoint with errors raises with its findings."""

from __future__ import annotations

import shutil

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name

import ckptspec
from ckptspec.errors import CheckpointInvalid


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
def test_load_state_dict_equals_the_job(world_size, save, ds):
    import torch

    entry = ds.path(dcp_save_name(world_size))
    oracle = torch.load(entry / "oracle.pt", weights_only=True)["params" if save == "dcp" else "params2"]
    got = ckptspec.load_state_dict(entry / save)
    assert sorted(got) == sorted(oracle)  # in the .metadata's order (not the model's at world size > 1)
    for name, tensor in got.items():
        assert tensor.dtype == oracle[name].dtype and tensor.shape == oracle[name].shape, name
        assert torch.equal(tensor, oracle[name]), name
    assert got["head.weight"] is not got["emb.weight"]  # a DCP save records no tie: each name its own tensor
    arrays = ckptspec.load_state_dict(entry / save, "numpy")
    assert all((arrays[n] == oracle[n].numpy()).all() and arrays[n].shape == tuple(oracle[n].shape) for n in oracle)


def test_dtype_casts_floating_tensors_only(ds):
    import torch

    entry = ds.path(dcp_save_name(2))
    oracle = torch.load(entry / "oracle.pt", weights_only=True)["params"]
    got = ckptspec.load_state_dict(entry / "dcp", dtype="bf16")
    for name, tensor in oracle.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_errors_raise_with_their_findings(ds, tmp_path):
    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    (directory / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointInvalid) as refused:
        ckptspec.load_state_dict(directory)
    assert [f.code for f in refused.value.findings] == ["CK252"]
    with pytest.raises(ValueError, match="a DCP checkpoint has none"):
        ckptspec.load_state_dict(ds.path(dcp_save_name(2)) / "dcp", tag="global_step1")
