"""FSDP -> DeepSpeed (issue #42): ``ckptspec reshard DCP_DIR OUT --to deepspeed --world-size N --stage 1|2|3
[--model-dtype bf16]``, loaded by DeepSpeed.

The saves are tests/_harness/dcp_save_job.py's (FSDP2 at world size 1, 2 and 3, gloo, AdamW with two param groups;
a tie, a frozen parameter, buffers). reshard_job.py's "dcp" tasks (scenarios.DCP_RESHARDS: ZeRO-1/2/3 at world
size 2 and 3, fp32 and bf16 jobs) reshard one on rank 0 and load it with ``engine.load_checkpoint`` into a DeepSpeed
job of the same model and param groups, whose frozen parameters and buffers held noise before the load
(before_load.py). What the engine then holds is compared here with the FSDP2 job's ``full_tensor()`` oracles.
"""

from __future__ import annotations

import pytest
from _harness.scenarios import DCP_RESHARDS, dcp_save_name


@pytest.mark.parametrize("name", sorted(DCP_RESHARDS))
def test_a_deepspeed_job_resumes_the_fsdp2_save_bit_for_bit(name, ds):
    import torch

    saved, _, _, dtype = DCP_RESHARDS[name]
    oracle = torch.load(ds.path(dcp_save_name(saved)) / "oracle.pt", weights_only=True)
    got = torch.load(ds.path(name) / "dcp_load.pt", weights_only=False)
    assert got["reshard_error"] is None and got["error"] is None, got
    assert sorted(got["master"]) == sorted(oracle["state"])  # every trained parameter, no other
    model_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for param, master in got["master"].items():
        assert torch.equal(master, oracle["params"][param]), param
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][param][key], oracle["state"][param][key]), (param, key)
        # the job's weights: the master cast to its dtype (what DeepSpeed's own step and load give it)
        weight = got["weights"][param]
        assert weight.dtype == model_dtype and torch.equal(weight, oracle["params"][param].to(model_dtype)), param
    assert got["step"] == [1.0, 1.0]  # one step before the save, one per param group in DeepSpeed
    assert all(float(s["step"]) == 1.0 for s in oracle["state"].values())
    assert [g["weight_decay"] for g in got["hyperparameters"]] == [0.01, 0.0]
    for group in got["hyperparameters"]:
        assert (group["lr"], group["betas"], group["eps"]) == (0.01, (0.9, 0.999), 1e-08)
    # the frozen parameter and the buffers: the saved values, not the noise the job held before the load
    assert sorted(got["module"]) == ["frozen.bias", "frozen.weight", "running", "step_count"]
    for key, tensor in got["module"].items():  # a bf16 job's frozen parameters are bf16 (DeepSpeed casts them)
        assert torch.equal(tensor, oracle["params"][key].to(tensor.dtype)), key
    assert got["module"]["frozen.weight"].dtype == model_dtype and got["module"]["running"].dtype == torch.float32


# The one more step's bounds (max and mean absolute difference from the FSDP2 job's second-step parameters, whose step
# moved them by up to 1.03e-2, 6.5e-3 on average). An fp32 job computes the FSDP2 job's step up to the order of its
# reductions: measured max 0 to 1.5e-8. A bf16 job's forward and gradients are bf16 (its masters fp32), and Adam's
# normalized update turns a bf16 rounding of a small gradient into a sizable change of a few elements: measured max
# 5.1e-3, mean 3.9e-5 (0.6% of the mean step) in each of the three bf16 targets.
BOUNDS = {"fp32": (1e-7, 1e-9), "bf16": (6e-3, 1e-4)}


@pytest.mark.parametrize("name", sorted(DCP_RESHARDS))
def test_one_more_step_matches_the_fsdp2_jobs_second(name, ds):
    import torch

    saved, _, _, dtype = DCP_RESHARDS[name]
    oracle = torch.load(ds.path(dcp_save_name(saved)) / "oracle.pt", weights_only=True)
    got = torch.load(ds.path(name) / "dcp_load.pt", weights_only=False)
    diff = torch.cat([(got["params2"][n] - oracle["params2"][n]).abs().flatten() for n in got["params2"]])
    moved = min((oracle["params2"][n] - oracle["params"][n]).abs().max().item() for n in got["params2"])
    most, mean = BOUNDS[dtype]
    assert diff.max().item() <= most < moved and diff.mean().item() <= mean, (diff.max(), diff.mean(), moved)
