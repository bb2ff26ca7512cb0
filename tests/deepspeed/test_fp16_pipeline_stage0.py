"""#40: DeepSpeed 0.19.8's fp16 pipeline at ZeRO stage 0 (``pp2-s0-fp16-ws2``), described from its files.

Its job wraps the client torch Adam in FP16_UnfusedOptimizer: no optimizer-state files, each stage's model states hold
``optimizer`` = {dynamic loss scale, ``fp32_groups`` (one fp32 master per parameter), ``optimizer_state_dict`` (the
torch state, per parameter index, no names)}, the layer files' weights fp16 (``deepspeed/layout/
pipeline_torch_optimizer.py``). Ground truth: the fp32 masters each rank's job held when it saved (its oracle), and the
Adam state and loss scale it saved (read here with torch), bit for bit.
Written for another data degree: tests/export/test_reshard_pipeline_stage0_fp16.py.
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

ENTRY = "pp2-s0-fp16-ws2"


def _saved(entry: Path) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """``<name>`` -> (its stage's FP16_UnfusedOptimizer state, the Adam state saved for it), by the oracle's order."""
    out = {}
    for oracle in rank_oracles(entry):
        stage = oracle["coords"]["pp"]
        wrapper = torch.load(tag_dir(entry) / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)["optimizer"]
        inner = wrapper["optimizer_state_dict"]
        assert [g["params"] for g in inner["param_groups"]] == [list(range(len(oracle["masters"])))]
        for i, name in enumerate(oracle["masters"]):
            assert bits_equal(wrapper["fp32_groups"][0][i], oracle["masters"][name]), name
            out[name] = (wrapper, inner["state"][i])
    return out


def test_it_is_described_valid_with_the_fp32_masters_its_job_held(ds):
    entry = ds.path(ENTRY)
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.PIPELINE_STAGE0 and [d.id for d in opened.domains] == ["pp0-tp0", "pp1-tp0"]
    assert all(d.masters and d.masters.stored_in == "model_states" for d in opened.domains)
    masters = union_of([oracle["masters"] for oracle in rank_oracles(entry)])
    read = opened.state_dict(framework="torch")
    assert read.keys() == masters.keys() and len(masters) == 12
    assert all(read[n].dtype == torch.float32 and bits_equal(read[n], m) for n, m in masters.items())


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
    saved = _saved(entry)
    assert saved.keys() == masters.keys()
    assert set(state) == {f"{n}.{k}" for n in masters for k in ("exp_avg", "exp_avg_sq")}
    for name, (_, entries) in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(state[f"{name}.{key}"], entries[key]), (name, key)
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        optimizer = f.metadata()["ckptspec.optimizer"]
    steps = {float(e["step"]) for _, e in saved.values()}
    assert steps == {3.0} and '"step": 3.0' in optimizer and '"lr": 0.01' in optimizer


def test_the_loss_scale_is_the_one_fp16_unfused_optimizer_saved(ds):
    """The moments' locator carries each stage's FP16_UnfusedOptimizer state (what a writer takes the scale from)."""
    from ckptspec.checkpoint.states import StateCache
    from ckptspec.deepspeed.layout.moments import MomentFinder

    entry = ds.path(ENTRY)
    folder, saved = tag_dir(entry), _saved(entry)
    opened = ckptspec.open(entry)
    finder = MomentFinder(folder, StateCache())
    for domain in opened.domains:
        for loc in domain.masters.tensors:
            moments = finder.locate(loc.param, loc.file, list(loc.key), loc.element_offset, loc.numel)
            wrapper = saved[loc.param][0]
            assert moments.wrapper["dynamic_loss_scale"] is True and wrapper["dynamic_loss_scale"] is True
            for key in ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window"):
                assert moments.wrapper[key] == wrapper[key], (loc.param, key)
    assert {w["cur_scale"] for w, _ in saved.values()} == {16}


@pytest.mark.parametrize(
    "change,refusal",
    [
        ("master", "optimizer/fp32_groups/0/0 is no master of state entry 0's shape"),
        ("frozen", "holds 'extra', which no stage's optimizer steps"),
    ],
)
def test_what_cannot_be_named_is_refused_by_name(change, refusal, ds, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(ds.path(ENTRY), copy, ignore=shutil.ignore_patterns("*.pt", "eval*", "job.log"))
    shutil.copytree(tag_dir(ds.path(ENTRY)), tag_dir(copy), dirs_exist_ok=True)
    if change == "master":
        changed = tag_dir(copy) / "mp_rank_00_model_states.pt"
        state = torch.load(changed, weights_only=False)
        state["optimizer"]["fp32_groups"][0][0] = state["optimizer"]["fp32_groups"][0][0][:8].clone()
    else:
        changed = tag_dir(copy) / "layer_04-model_states.pt"
        state = torch.load(changed, weights_only=True)
        state["extra"] = torch.zeros(3, dtype=torch.float16)
    torch.save(state, changed)
    result = CliRunner().invoke(cli, ["validate", str(copy)])
    assert result.exit_code == 1 and "CK202" in result.output and refusal in result.output, result.output
