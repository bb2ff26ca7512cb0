"""Issue #39: the optimizer state (``reconstruct --optimizer-state``, ``ckptspec.load_optimizer_state``) of
the kinds whose checkpoint index locates fp32 masters: ZeRO stage 0 (fp32, bf16, fp16, FusedAdam's flat
groups), native MoE (ep2 at stages 0/1/2, world sizes 2 and 4) and the stage-0 bf16 pipeline.

Oracle: the optimizer state DeepSpeed holds after loading the checkpoint (``<name>+optim``,
tests/_harness/optim_job.py): ``safe_get_full_optimizer_state`` where DeepSpeed's getter answers (MoE at
stage 1/2, ``BF16_Optimizer``), else the wrapped torch optimizer's state of each parameter's fp32 master
(stage 0, where the getter returns None), every expert from the rank that owns it. The export must equal
it bit for bit, every state of every parameter under its whole-model name, with each param group's step
and hyperparameters.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _harness import scenarios

import ckptspec

SOURCES = scenarios.OPTIM_SOURCES
GETTER = [n for n in SOURCES if n.startswith(("moe-ep2-s1-", "moe-ep2-s2-", "pp2-s0-"))]  # an _hp_mapping


def _oracle(ds, name) -> dict:
    """Every rank's record merged: global name -> state, step, group; rank 0's param groups."""
    import torch

    entry = ds.path(scenarios.optim_name(name))
    merged: dict = {"state": {}, "step": {}, "group": {}, "getter": {}}
    for rank in range(scenarios.REGISTRY[name].world_size):
        record = torch.load(entry / f"optim.rank{rank}.pt", weights_only=True)
        for part in ("state", "step", "group", "getter"):
            for param, value in record[part].items():
                merged[part].setdefault(param, value)
        merged.setdefault("param_groups", record["param_groups"])
    merged["load"] = json.loads((entry / "optim.json").read_text())
    return merged


def _bits_equal(ours, theirs) -> bool:
    import torch

    return (
        ours.dtype == theirs.dtype
        and ours.shape == theirs.shape
        and torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))
    )


def _plain(settings: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items() if v is not None}


@pytest.mark.parametrize("name", SOURCES)
def test_exported_state_is_what_deepspeed_loads(ckptspec_cli, ds, name, tmp_path):
    from safetensors import safe_open

    oracle = _oracle(ds, name)
    assert oracle["state"], "the job recorded the optimizer state"
    # where the oracle comes from: DeepSpeed's getter where it answers, the torch state elsewhere
    assert all(oracle["getter"].values()) == (name in GETTER) and any(oracle["getter"].values()) == (name in GETTER)
    # DeepSpeed's load_checkpoint fails on the stage-0 bf16 pipeline's optimizer state (the ZeRO loader reads it)
    assert (oracle["load"]["load_checkpoint_error"] is not None) == name.startswith("pp2-s0-")
    out = tmp_path / "out"
    result = ckptspec_cli("reconstruct", ds.path(name), out, "--quiet", "--optimizer-state")
    assert result.output == ""
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        meta = f.metadata()
        exported = {k: f.get_tensor(k) for k in f.keys()}
    states = json.loads(meta["ckptspec.states"])
    assert sorted(states) == sorted(oracle["state"])  # every trainable parameter, experts by global name
    for param, by_key in oracle["state"].items():
        assert set(states[param]) == set(by_key) == {"exp_avg", "exp_avg_sq"}
        for key, theirs in by_key.items():
            assert _bits_equal(exported[states[param][key]], theirs), f"{name}: {param}.{key}"
    assert len(exported) == 2 * len(oracle["state"])
    assert json.loads(meta["ckptspec.optimizer_groups"]) == oracle["group"]
    optimizer = json.loads(meta["ckptspec.optimizer"])
    steps = {g["optimizer_group"]: g["step"] for g in optimizer["groups"]}
    assert steps == {oracle["group"][p]: step for p, step in oracle["step"].items()}
    assert [g["hyperparameters"] for g in optimizer["groups"]] == [_plain(g) for g in oracle["param_groups"]]


@pytest.mark.parametrize("name", ["s0-fp32-ws2", "s0-bf16-ws2-fused", "moe-ep2-s0-bf16-ws4", "moe-ep2-s2-fp32-ws4"])
def test_load_optimizer_state_of_an_index_with_masters(ds, name):
    """The Python API gives the same arrays, in each parameter's shape, and the optimizer's scalars."""
    oracle = _oracle(ds, name)
    state, optimizer = ckptspec.load_optimizer_state(ds.path(name))
    assert sorted(state) == sorted(oracle["state"])
    for param, by_key in oracle["state"].items():
        for key, theirs in by_key.items():
            ours = state[param][key]
            assert ours.dtype == np.float32 and list(ours.shape) == list(theirs.shape), (param, key)
            assert np.array_equal(ours.view(np.uint32), theirs.numpy().view(np.uint32)), (param, key)
    assert optimizer["class"] == "unknown"
    assert [g["optimizer_group"] for g in optimizer["groups"]] == sorted(set(oracle["group"].values()))
