"""The ground truth of DCP as an input (issue #42): what the saving FSDP2 jobs recorded is what they saved.

tests/_harness/dcp_save_job.py trains the tiny model with FSDP2 (CPU, gloo) and AdamW at world size 1, 2
and 3 and saves ``dcp.save({"model": ..., "optim": ...})`` from ``get_state_dict``; it records every
parameter and Adam moment (``full_tensor()``) after the step. Here torch's own readers agree with those
oracles bit for bit: ``dcp_to_torch_save`` (written by the job) and a ``dcp.load`` into a plain state dict.
"""

from __future__ import annotations

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name


def _check(flat: dict, params: dict, state: dict) -> None:
    import torch

    assert sorted(flat["model"]) == sorted(params)
    for name, tensor in params.items():
        assert flat["model"][name].dtype == tensor.dtype and torch.equal(flat["model"][name], tensor), name
    assert sorted(flat["optim"]["state"]) == sorted(state)
    for name, moments in state.items():
        got = flat["optim"]["state"][name]
        assert sorted(got) == sorted(moments) == ["exp_avg", "exp_avg_sq", "step"]
        for key, tensor in moments.items():
            assert torch.equal(got[key], tensor), (name, key)


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_the_saves_hold_what_the_jobs_recorded(world_size, ds, tmp_path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    entry = ds.path(dcp_save_name(world_size))
    oracle = torch.load(entry / "oracle.pt", weights_only=True)
    assert oracle["world_size"] == world_size
    for save in ("dcp", "dcp-step2"):
        assert sorted(p.name for p in (entry / save).iterdir()) == [".metadata"] + [
            f"__{rank}_0.distcp" for rank in range(world_size)
        ]
    _check(torch.load(entry / "torch_save.pt", weights_only=True), oracle["params"], oracle["state"])
    dcp_to_torch_save(str(entry / "dcp-step2"), str(tmp_path / "step2.pt"))
    _check(torch.load(tmp_path / "step2.pt", weights_only=True), oracle["params2"], oracle["state2"])
    # The second step moved every trainable parameter: the two saves differ (the fault tests swap their files).
    assert not torch.equal(oracle["params"]["l1.weight"], oracle["params2"]["l1.weight"])
