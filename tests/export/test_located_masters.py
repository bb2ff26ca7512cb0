"""#17: the fp32 masters of ZeRO stage-0 (dense and MoE) and universal checkpoints, read by ckptspec
from the files alone, equal bit for bit what the live engine held in the training job
(tests/_harness/job/parallel.py: ``safe_get_full_fp32_param``, ``FP16_UnfusedOptimizer.fp32_groups``,
the parameters themselves at stage 0; every expert from the rank that owns it) and, for universal
folders, DeepSpeed's own ``fp32.pt`` tensors (loaded with torch here, the oracle)."""

from __future__ import annotations

import json

import pytest
from _harness import scenarios

from ckptspec.export.located import (
    check_stage0_replicas,
    load_moe_zero_masters,
    load_stage0_masters,
    load_universal_masters,
)

pytestmark = pytest.mark.deepspeed

STAGE0 = sorted(n for n in scenarios.PARALLEL if n.startswith(("s0-", "moe-ep2-s0-")))
UNIVERSAL = ["uc-s2-bf16-ws2", "uc-s3-bf16-ws2"]
MOE_ZERO = sorted(n for n in scenarios.PARALLEL if n.startswith(("moe-ep2-s1-", "moe-ep2-s2-")))


def _info(ds, name):
    return json.loads((ds.path(name) / "parallel.json").read_text())


def _live_masters(ds, name) -> dict:
    """Global name -> the master every rank holding it gathered (they agree: test_parallel_harness)."""
    import torch

    out = {}
    for rank in range(scenarios.REGISTRY[name].world_size):
        oracle = torch.load(ds.path(name) / f"oracle.rank{rank}.pt", weights_only=True)
        for local, master in oracle["masters"].items():
            out.setdefault(oracle["params"][local]["global_name"], master)
    return out


def _equal_bits(array, tensor) -> bool:
    import numpy as np

    expected = tensor.detach().contiguous().numpy()
    return array.shape == expected.shape and np.array_equal(array.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", STAGE0)
def test_stage0_masters_equal_the_live_engine(ds, name):
    tag = ds.path(name) / _info(ds, name)["tag"]
    got = load_stage0_masters(tag)
    live = _live_masters(ds, name)
    assert sorted(got) == sorted(live)
    wrong = sorted(n for n in live if not _equal_bits(got[n], live[n]))
    assert wrong == [], name


@pytest.mark.parametrize("name", MOE_ZERO)
def test_moe_zero_masters_equal_the_live_engine(ds, name):
    """Every expert from the rank that owns it (expert groups partitioned over the
    expert-data-parallel group: [2, 1] at world size 2, [4, 2] at 4) and the dense parameters."""
    tag = ds.path(name) / _info(ds, name)["tag"]
    got = load_moe_zero_masters(tag)
    live = _live_masters(ds, name)
    assert sorted(got) == sorted(live)
    wrong = sorted(n for n in live if not _equal_bits(got[n], live[n]))
    assert wrong == [], name


@pytest.mark.parametrize("name", UNIVERSAL)
def test_universal_masters_equal_fp32_pt_and_the_live_engine(ds, name):
    import torch

    folder = ds.path(name) / _info(ds, name)["universal"]["output_folder"]
    got = load_universal_masters(folder)
    live = _live_masters(ds, name)
    assert sorted(got) == sorted(live)
    for n, array in got.items():
        value = torch.load(folder / "zero" / n / "fp32.pt", map_location="cpu", weights_only=True)
        tensor = value["param"] if isinstance(value, dict) else value
        assert _equal_bits(array, tensor.view(live[n].shape)), n
        assert _equal_bits(array, live[n]), n


def test_a_master_of_another_shape_is_refused_by_name(ds, tmp_path):
    """The optimizer's order is checked against the module's, shape by shape: swapping two
    parameters' masters in ``fp32_groups`` is CK202 naming the parameter, never a wrong pairing."""
    import shutil

    import torch

    from ckptspec.errors import UnsupportedCheckpoint

    source = ds.path("s0-bf16-ws2") / _info(ds, "s0-bf16-ws2")["tag"]
    tag = tmp_path / "global_step2"
    shutil.copytree(source, tag)
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    group = state["optimizer"]["fp32_groups"][0]
    group[0], group[1] = group[1], group[0]
    torch.save(state, path)
    with pytest.raises(UnsupportedCheckpoint, match="blocks.0.up.weight") as info:
        load_stage0_masters(tag)
    assert info.value.code == "CK202"


def test_a_missing_expert_file_is_refused_by_name(ds, tmp_path):
    """The derived expert layout is cross-checked with the expert files: without expert 3's file,
    its parameters are named (CK202), never read from another rank's partition under a guess."""
    import shutil

    from ckptspec.errors import UnsupportedCheckpoint

    name = "moe-ep2-s1-fp32-ws4"
    tag = tmp_path / "global_step2"
    shutil.copytree(ds.path(name) / _info(ds, name)["tag"], tag)
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UnsupportedCheckpoint, match=r"deepspeed_experts\.3\.0\.weight") as info:
        load_moe_zero_masters(tag)
    assert info.value.code == "CK202"


@pytest.mark.parametrize("ws,copies", [(2, 5 + 9), (4, 5 + 13)])
def test_stage0_moe_copies_of_the_masters_are_compared(ds, tmp_path, ws, copies):
    """FP16_UnfusedOptimizer with MoE saves the dense masters once per expert-parallel rank and
    expp_rank_0's state again in mp_rank_00 (5 dense + rank 0's experts' 4 per local expert):
    equal in DeepSpeed's files; a flipped bit in a copy is CK401 naming the parameter and the file."""
    import shutil

    name = f"moe-ep2-s0-bf16-ws{ws}"
    source = ds.path(name) / _info(ds, name)["tag"]
    assert check_stage0_replicas(source) == copies
    tag = tmp_path / "global_step2"
    shutil.copytree(source, tag)
    from ckptspec.deepspeed.masters import stage0_replicas

    _, copy = next(
        (m, c) for m, c in stage0_replicas(tag) if c.segments[0][0].startswith("expp_rank_1") and c.name == "head.bias"
    )
    rel, offset, _ = copy.segments[0]
    data = bytearray((tag / rel).read_bytes())
    data[offset] ^= 0x01
    (tag / rel).write_bytes(bytes(data))
    with pytest.raises(Exception, match="head.bias") as info:
        check_stage0_replicas(tag)
    assert info.value.code == "CK401" and rel in str(info.value)
