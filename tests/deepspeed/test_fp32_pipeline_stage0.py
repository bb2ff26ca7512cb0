"""#40: DeepSpeed 0.19.8's fp32 pipeline at ZeRO stage 0 (``pp2-s0-fp32-ws2``), described from its files.

Its job steps the torch optimizer itself: no optimizer-state files, each stage's model states hold that optimizer's
``state_dict()`` (state per parameter index, no names) and the layer files' fp32 weights are the masters
(``deepspeed/layout/pipeline_torch_optimizer.py``). Ground truth: the masters each rank's job held when it saved (its
oracle), and the Adam state it saved (torch's ``state_dict()`` of the job's own optimizer, read here with torch), bit
for bit, named by the oracle's order of the stage's parameters.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import bits_equal, rank_oracles, union_of
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

ENTRY = "pp2-s0-fp32-ws2"


def _saved_states(entry: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``<name>`` -> the Adam state the job saved for it: each stage's entries in its oracle's parameter order."""
    out = {}
    for oracle in rank_oracles(entry):
        stage = oracle["coords"]["pp"]
        saved = torch.load(tag_dir(entry) / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)
        assert [g["params"] for g in saved["optimizer"]["param_groups"]] == [list(range(len(oracle["masters"])))]
        for i, name in enumerate(oracle["masters"]):
            out[name] = saved["optimizer"]["state"][i]
    return out


def test_it_is_described_valid_with_the_masters_its_job_held(ds):
    entry = ds.path(ENTRY)
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.PIPELINE_STAGE0 and [d.id for d in opened.domains] == ["pp0-tp0", "pp1-tp0"]
    assert all(d.masters and d.masters.stored_in == "module" for d in opened.domains)
    assert all(d.manifest.layout.world_size == 1 for d in opened.domains)
    masters = union_of([oracle["masters"] for oracle in rank_oracles(entry)])
    read = opened.state_dict(framework="torch")
    assert read.keys() == masters.keys() and len(masters) == 12
    assert all(bits_equal(read[n], m) for n, m in masters.items())


def test_generate_hash_then_validate_against_the_index(ds, tmp_path):
    entry, index = ds.path(ENTRY), tmp_path / "index.json"
    assert CliRunner().invoke(cli, ["generate", str(entry), "--hash", "-o", str(index)]).exit_code == 0
    result = CliRunner().invoke(cli, ["validate", str(index), "--checkpoint", str(entry)])
    assert result.exit_code == 0, result.output


def test_reconstruct_with_optimizer_state_is_the_jobs_bit_for_bit(ds, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    entry, out = ds.path(ENTRY), tmp_path / "out"
    result = CliRunner().invoke(cli, ["reconstruct", str(entry), str(out), "--optimizer-state", "-q"])
    assert result.exit_code == 0, result.output
    weights, state = load_file(out / "model.safetensors"), load_file(out / "optimizer.safetensors")
    masters = union_of([oracle["masters"] for oracle in rank_oracles(entry)])
    assert weights.keys() == masters.keys() and all(bits_equal(weights[n], m) for n, m in masters.items())
    saved = _saved_states(entry)
    assert saved.keys() == masters.keys()
    assert set(state) == {f"{n}.{k}" for n in masters for k in ("exp_avg", "exp_avg_sq")}
    for name, entries in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(state[f"{name}.{key}"], entries[key]), (name, key)
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        optimizer = f.metadata()["ckptspec.optimizer"]
    steps = {float(e["step"]) for e in saved.values()}
    assert steps == {2.0} and '"step": 2.0' in optimizer and '"lr": 0.01' in optimizer


@pytest.mark.parametrize(
    "change,layer,refusal",
    [
        ("frozen", 4, "holds 'extra', which no stage's optimizer steps"),  # a tensor no optimizer entry names
        ("shape", 0, "state entry 0 of stage 0 has shape [16, 16]"),  # a weight that is not the entry's
    ],
)
def test_what_cannot_be_named_is_refused_by_name(change, layer, refusal, ds, tmp_path):
    """The state names no parameter: a layer tensor the stages' optimizers do not take in order is CK202."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path(ENTRY), copy, ignore=shutil.ignore_patterns("*.pt", "eval*", "job.log"))
    shutil.copytree(tag_dir(ds.path(ENTRY)), tag_dir(copy), dirs_exist_ok=True)
    changed = tag_dir(copy) / f"layer_{layer:02d}-model_states.pt"
    tensors = torch.load(changed, weights_only=True)
    if change == "frozen":
        tensors["extra"] = torch.zeros(3)
    else:
        tensors["weight"] = tensors["weight"][:8].clone()
    torch.save(tensors, changed)
    result = CliRunner().invoke(cli, ["validate", str(copy)])
    assert result.exit_code == 1 and "CK202" in result.output and refusal in result.output, result.output
    assert changed.name in result.output, result.output
