"""``ckptspec reconstruct DCP_DIR OUT`` (issue #42): the model weights of a real FSDP2 save as one safetensors file,
equal bit for bit to the saving job's ``full_tensor()`` (tests/_harness/dcp_save_job.py's oracles) and to torch's own
``dcp_to_torch_save``; a checkpoint with errors writes nothing."""

from __future__ import annotations

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
    result = _run("reconstruct", ds.path(dcp_save_name(1)) / "dcp", tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 2
    assert "--optimizer-state: not for a DCP checkpoint (.metadata) yet" in result.output
    assert not (tmp_path / "out").exists()


def test_runs_of_a_chunk_split_on_an_inner_dimension():
    """FSDP2 splits dim 0 (one run a chunk); any other box is a run per row of its outer dimensions."""
    assert list(runs((4, 6), Chunk((1, 2), (2, 3)))) == [(0, 8, 3), (3, 14, 3)]
    assert list(runs((4, 6), Chunk((2, 0), (2, 6)))) == [(0, 12, 12)]
    assert list(runs((), Chunk((), ()))) == [(0, 0, 1)]
    assert list(runs((2, 3, 4), Chunk((0, 1, 0), (2, 2, 4)))) == [(0, 4, 8), (8, 16, 8)]
