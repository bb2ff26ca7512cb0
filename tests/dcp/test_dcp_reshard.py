"""FSDP -> DeepSpeed (issue #42): ``ckptspec reshard DCP_DIR OUT --world-size N --stage 1|2``, loaded by DeepSpeed.

The saves are tests/_harness/dcp_save_job.py's (FSDP2, gloo, AdamW with two param groups; a tie, a frozen
parameter, buffers). reshard_job.py's "dcp" tasks (scenarios.DCP_RESHARDS) reshard one on rank 0 and load it with
``engine.load_checkpoint`` into a DeepSpeed fp32 job of the same model and param groups, whose frozen parameters and
buffers held noise before the load (before_load.py). What the engine then holds is compared here with the FSDP2
job's ``full_tensor()`` oracles.
"""

from __future__ import annotations

import pytest
from _harness.scenarios import DCP_RESHARDS, dcp_save_name


@pytest.mark.parametrize("name", sorted(DCP_RESHARDS))
def test_a_deepspeed_job_resumes_the_fsdp2_save_bit_for_bit(name, ds):
    import torch

    saved, _, _ = DCP_RESHARDS[name]
    oracle = torch.load(ds.path(dcp_save_name(saved)) / "oracle.pt", weights_only=True)
    got = torch.load(ds.path(name) / "dcp_load.pt", weights_only=False)
    assert got["reshard_error"] is None and got["error"] is None, got
    assert sorted(got["master"]) == sorted(oracle["state"])  # every trained parameter, no other
    for param, master in got["master"].items():
        assert torch.equal(master, oracle["params"][param]), param
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][param][key], oracle["state"][param][key]), (param, key)
    assert got["step"] == [1.0, 1.0]  # one step before the save, one per param group in DeepSpeed
    assert all(float(s["step"]) == 1.0 for s in oracle["state"].values())
    assert [g["weight_decay"] for g in got["hyperparameters"]] == [0.01, 0.0]
    for group in got["hyperparameters"]:
        assert (group["lr"], group["betas"], group["eps"]) == (0.01, (0.9, 0.999), 1e-08)
    # the frozen parameter and the buffers: the saved values, not the noise the job held before the load
    assert sorted(got["module"]) == ["frozen.bias", "frozen.weight", "running", "step_count"]
    for key, tensor in got["module"].items():
        assert torch.equal(tensor, oracle["params"][key]), key


@pytest.mark.parametrize("name", sorted(DCP_RESHARDS))
def test_one_more_step_matches_the_fsdp2_jobs_second(name, ds):
    import torch

    saved, _, _ = DCP_RESHARDS[name]
    oracle = torch.load(ds.path(dcp_save_name(saved)) / "oracle.pt", weights_only=True)
    got = torch.load(ds.path(name) / "dcp_load.pt", weights_only=False)
    worst = max((got["params2"][n] - oracle["params2"][n]).abs().max().item() for n in got["params2"])
    moved = min((oracle["params2"][n] - oracle["params"][n]).abs().max().item() for n in got["params2"])
    assert worst <= 1e-7 < moved, (worst, moved)  # measured: 0 (ws2 -> ZeRO-1), 7.5e-9 (ws3 -> ZeRO-2)
