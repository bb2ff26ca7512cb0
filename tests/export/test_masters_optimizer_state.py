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
from _harness.parallel_oracles import check_exported_optimizer_state

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


@pytest.mark.parametrize("name", SOURCES)
def test_exported_state_is_what_deepspeed_loads(ckptspec_cli, ds, name, tmp_path):
    oracle = _oracle(ds, name)
    assert oracle["state"], "the job recorded the optimizer state"
    # where the oracle comes from: DeepSpeed's getter where it answers, the torch state elsewhere
    assert all(oracle["getter"].values()) == (name in GETTER) and any(oracle["getter"].values()) == (name in GETTER)
    # DeepSpeed's load_checkpoint fails on the stage-0 bf16 pipeline's optimizer state (the ZeRO loader reads it)
    assert (oracle["load"]["load_checkpoint_error"] is not None) == name.startswith("pp2-s0-")
    out = tmp_path / "out"
    result = ckptspec_cli("reconstruct", ds.path(name), out, "--quiet", "--optimizer-state")
    assert result.output == ""
    check_exported_optimizer_state(out, oracle, name)


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


def _sha256(tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def _live_masters(ds, name) -> dict:
    import torch

    out = {}
    for rank in range(scenarios.REGISTRY[name].world_size):
        oracle = torch.load(ds.path(name) / f"oracle.rank{rank}.pt", weights_only=True)
        for local, master in oracle["masters"].items():
            out.setdefault(oracle["params"][local]["global_name"], master.detach().float())
    return out


@pytest.mark.parametrize("name", ["s0-fp32-ws2", "s0-bf16-ws2-fused", "moe-ep2-s1-bf16-ws2", "pp2-s0-bf16-ws2"])
def test_generate_hash_digests_every_master_and_moment(ckptspec_cli, ds, name, tmp_path):
    """``generate --hash``: each domain's manifest is format 1.1 and gives every parameter the sha256 of its
    fp32 master (the live engine's, oracle.rank*.pt) and of each moment (DeepSpeed's loaded state)."""
    doc = tmp_path / "index.json"
    ckptspec_cli("generate", ds.path(name), "-o", doc, "--hash")
    index = json.loads(doc.read_text())
    masters, moments = _live_masters(ds, name), _oracle(ds, name)["state"]
    local = {s["local_name"]: p["name"] for p in index["parameters"] for s in p["shards"]}
    seen = set()
    for domain in index["domains"]:
        assert domain["manifest"]["format_version"] == "1.1.0"
        for group in domain["manifest"]["groups"]:
            for p in group["params"]:
                whole = local.get(p["name"], p["name"])
                assert p["digest"]["sha256"] == _sha256(masters[whole]), (name, whole)
                assert {k: d["sha256"] for k, d in p["state_digests"].items()} == {
                    k: _sha256(t) for k, t in moments[whole].items()
                }, (name, whole)
                seen.add(whole)
    assert seen == set(masters) == set(moments)


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 1]))


def _digests_only(index: dict) -> dict:
    """The index without any file hash: only the tensor digests can tell a changed byte."""
    for domain in index["domains"]:
        for f in domain["manifest"]["files"]:
            f.pop("hash", None)
    for f in index.get("expert_files", []) + index.get("layer_files", []):
        f.pop("hash", None)
    return index


@pytest.mark.parametrize("what", ["master", "moment"])
def test_a_changed_byte_is_found_by_its_digest_as_it_is_read(ckptspec_cli, ds, what, tmp_path):
    """The digests ``generate --hash`` wrote are checked by ``validate INDEX --checkpoint`` and as the bytes
    stream (CK222): the lowest bit of one fp32 master (a bf16 run: its rounded weight is unchanged, so
    the weights-vs-masters check passes) or of one moment, flipped in a copy; the file hashes removed
    from the index. Nothing is written."""
    import shutil

    from click.testing import CliRunner

    from ckptspec.checkpoint.states import StateCache
    from ckptspec.cli import cli as command
    from ckptspec.deepspeed.layout.moments import MomentFinder

    source = ds.path("moe-ep2-s1-bf16-ws2")
    tag = (source / "latest").read_text().strip()
    copy = tmp_path / "ckpt"
    shutil.copytree(source / tag, copy / tag)
    (copy / "latest").write_text(tag)
    doc = tmp_path / "index.json"
    ckptspec_cli("generate", copy, "-o", doc, "--hash")
    index = _digests_only(json.loads(doc.read_text()))
    doc.write_text(json.dumps(index))
    loc = index["domains"][1]["masters"]["tensors"][0]  # an expert's master, in a ZeRO partition
    if what == "master":
        _flip(copy / tag / loc["file"], loc["data_offset"] + loc["element_offset"] * 4)
    else:
        found = MomentFinder(copy / tag, StateCache()).locate(
            loc["param"], loc["file"], loc["key"], loc["element_offset"], loc["numel"]
        )
        _flip(copy / tag / found.file, found.ranges["exp_avg_sq"][0])
    result = CliRunner().invoke(command, ["validate", str(doc), "--checkpoint", str(copy)])
    assert result.exit_code == 1, result.output
    where = "digest" if what == "master" else "state_digests.exp_avg_sq"
    param = next(
        k for k, p in enumerate(index["domains"][1]["manifest"]["groups"][0]["params"]) if p["name"] == loc["param"]
    )
    assert f"$.domains[1].manifest.groups[0].params[{param}].{where}: CK222" in result.output, result.output
    out = tmp_path / "out"
    args = ["reconstruct", str(copy), str(out), "--manifest", str(doc), "--quiet", "--optimizer-state"]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 1, result.output
    assert "CK222" in result.output and loc["param"] in result.output, result.output
    assert not out.exists()
