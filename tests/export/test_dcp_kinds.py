"""``ckptspec export --format dcp`` and ``ckptspec.export_dcp`` on every kind of checkpoint (issue #39).

An FSDP2 job loads the export of a tensor x data parallel (AutoTP at ZeRO-2), a pipeline x data parallel
(ZeRO-1), a MoE (ep2, ZeRO-2) and a ZeRO stage-0 bf16 checkpoint into the consolidated model
(``parallel_models.reference_model``: tp1/pp1/ep1) at world size 2, the way a user loads it:
``get_state_dict``, ``dcp.load``, ``set_state_dict`` (tests/_harness/fsdp2_job.py, ``"parallel": true``).

Oracles, recorded by DeepSpeed, never by ckptspec: the live engine's fp32 masters on every rank before it
saved (``oracle.rank<R>.pt``; a tensor-parallel rank's master is its shard, cut from the whole tensor by
DeepSpeed's own affine pieces), and the optimizer state DeepSpeed holds after loading the checkpoint
(``<name>+optim``, tests/_harness/optim_job.py: ``safe_get_full_optimizer_state`` or the wrapped torch
optimizer's state; a tensor-parallel rank's in its local shape): Adam's moments, each parameter's step,
its param group and the group's hyperparameters. The FSDP2 job's extra step (all but MoE) is replayed
here with plain ``torch.optim.Adam`` on the consolidated model from that state and the same batch.

Every other kind (tensor parallel at ZeRO-1 and ZeRO-3, the stage-0 pipelines (bf16, fp32), MoE at stages 0 and 1,
stage 0 fp32) is exported here and read back with torch's DCP reader: every key equals the tensors the
one ``Checkpoint`` model gives (``state_dict``, ``optimizer_state``), which tests/test_every_kind.py and
tests/export/test_masters_optimizer_state.py hold against the live masters and DeepSpeed's loaded state.
A universal folder exports too: its moments are located in ``zero/<param>/exp_avg.pt``.
"""

from __future__ import annotations

import json

import pytest
from _harness import scenarios
from _harness.dcp_oracles import check_parallel_load
from _harness.parallel_oracles import bits_equal, info, read_dcp

import ckptspec

SOURCES = scenarios.DCP_PARALLEL_SOURCES
WORLD_SIZE = scenarios.DCP_PARALLEL_WORLD_SIZE


@pytest.mark.parametrize("source", SOURCES)
def test_fsdp2_loads_every_kind_as_deepspeed_holds_it(ds, source):
    """The oracles of tests/_harness/dcp_oracles.py (``check_parallel_load``): every rank's master, moments,
    steps, groups and hyperparameters as DeepSpeed holds them, bit for bit; the extra step as plain Adam's."""
    import torch

    got = torch.load(ds.path(scenarios.fsdp2_name(source, WORLD_SIZE)) / "fsdp2.pt", weights_only=False)
    check_parallel_load(ds, source, WORLD_SIZE, got)


EVERY_KIND = [
    "tp2-s1-fp32-ws2",
    "tp2-s3-bf16-ws2",
    "pp2-s1-fp32-ws2",
    "pp2-s0-bf16-ws2",
    "pp2-s0-fp32-ws2",
    "moe-ep2-s0-bf16-ws4",
    "moe-ep2-s1-fp32-ws4",
    "s0-fp32-ws2",
    "tp2-s2-bf16-ws2-extras",
    "pp2-s1-fp32-ws2-extras",
]


def _target(ds, name: str):
    entry = ds.path(name)
    if name.startswith("uc-"):  # the universal folder ds_to_universal wrote beside the checkpoint
        return entry / info(entry)["universal"]["output_folder"]
    return entry


@pytest.mark.parametrize("name", [*EVERY_KIND, "uc-s2-bf16-ws2"])
def test_export_dcp_holds_the_checkpoint_of_every_kind(ds, name, tmp_path):
    import torch

    target = _target(ds, name)
    checkpoint = ckptspec.open(target)
    result = ckptspec.export_dcp(target, tmp_path / "dcp")
    state = read_dcp(tmp_path / "dcp")
    weights = checkpoint.state_dict()
    moments, _ = checkpoint.optimizer_state()
    model_keys = {k.removeprefix("model.") for k in state if k.startswith("model.")}
    assert model_keys == set(weights)  # every tensor, frozen parameters, buffers and tied aliases included
    stored = {name: t.dtype for name, t in checkpoint.tensors.items()}
    for key, tensor in weights.items():  # fp32 masters; frozen weights and buffers as stored (widened exactly)
        ours = state[f"model.{key}"]
        assert str(ours.dtype).removeprefix("torch.") == stored[checkpoint.aliases.get(key, key)], key
        assert bits_equal(ours.to(tensor.dtype), tensor), key
    owners = {n for n in moments if n not in checkpoint.aliases}
    assert {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in state if k.startswith("optim.state.")} == owners
    for param in owners:
        for key, array in moments[param].items():
            assert bits_equal(state[f"optim.state.{param}.{key}"], torch.from_numpy(array)), f"{param}.{key}"
        assert state[f"optim.state.{param}.step"].dtype == torch.float32
    assert result.tensors == len(state)
    marker = json.loads((tmp_path / "dcp" / "ckptspec-export.json").read_text())
    assert marker["kind"] == checkpoint.kind.value
