"""#40: a MoE checkpoint (``deepspeed.moe.layer.MoE``, ZeRO stage 0, 1 or 2) written for a ZeRO stage-0 MoE job
(``ckptspec reshard --stage 0``, or a stage-0 source at another world size or expert-parallel degree;
export/reshard_moe_stage0.py): each expert-parallel rank's ``expp_rank_<e>`` optimizer file, the dense module and
expert-parallel rank 0's optimizer in the model states, the expert files.

Ground truth: a real DeepSpeed stage-0 MoE job of the target world size and expert degree resumes from what
ckptspec wrote (``engine.load_checkpoint``: tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records, by global
name, the Adam moments and step its torch optimizer holds, its param groups and the logits of a fixed batch; the
source's own job (its ``+optim`` entry) recorded the same after loading the source: equal, bit for bit (the logits
of a bf16 MoE at another expert degree within two bf16 epsilons, as in test_reshard_moe.py).
DeepSpeed's getters answer None at stage 0, so the job records no masters. Its masters are the files' (the module's
and expert files' weights in fp32; each expp_rank file's ``fp32_groups`` in bf16, which FP16_UnfusedOptimizer's
``load_state_dict`` copies as saved): compared with the source job's (its getter at ZeRO-1/2; the stage-0 saving
job's oracle), bit for bit. The files have the entries, dtypes and shapes of DeepSpeed's own stage-0 MoE save of the
same model (``moe-ep2-s0-*``) where the harness has one of the target's expert layout.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from _harness.parallel_oracles import (
    bits_equal,
    check_moe_groups_and_logits,
    check_same_moments_and_step,
    check_same_to_ckptspec,
    optim_records,
    rank_oracles,
    saved_entries,
    union_of,
)
from _harness.scenarios import (
    DEGREE_RESHARDS,
    PARALLEL_SPECS,
    is_moe_to_stage0,
    optim_name,
    reshard_target,
    source_spec,
)
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

CASES = sorted(n for n in DEGREE_RESHARDS if is_moe_to_stage0(n))
# What DeepSpeed's stage-0 optimizer wrapper is, per dtype (optim_job.py's record "source")
HELD_BY = {"fp32": "module (fp32, no masters)", **dict.fromkeys(("bf16", "fp16"), "FP16_UnfusedOptimizer.fp32_groups")}
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _tag_dir(root):
    return root / (root / "latest").read_text().strip()


def _source_masters(ds, source: str) -> dict:
    """Global name -> the fp32 master the source job held: DeepSpeed's getter after loading it (ZeRO-1/2), or the
    stage-0 saving job's own (its oracle: the fp32 module, or fp32_groups; local names mapped to global ones)."""
    if source_spec(source)["stage"]:
        return union_of([r["master"] for r in optim_records(ds.path(optim_name(source)))])
    oracles = rank_oracles(ds.path(source))
    return union_of([{o["params"][n]["global_name"]: m for n, m in o["masters"].items()} for o in oracles])


def _file_masters(tag, spec: dict) -> dict:
    """Global name -> the fp32 master the written files hold: fp32, the dense module's and the expert files'
    weights; bf16, each expp_rank file's fp32_groups (the dense group in module order, then its experts')."""
    model = _load(tag / "mp_rank_00_model_states.pt")
    experts = sorted((tuple(map(int, m.groups())), p) for p in tag.iterdir() if (m := _EXPERT_FILE.fullmatch(p.name)))
    names = {key: list(_load(path)) for key, path in experts}  # (layer, expert) -> its global names in order
    if spec["dtype"] == "fp32":
        out = dict(model["module"])
        for _, path in experts:
            out.update(_load(path))
        return out
    per_rank = spec["experts"] // spec["ep"]
    held: dict = {}
    for e in range(spec["ep"]):
        dense, local = _load(tag / f"expp_rank_{e}_mp_rank_00_optim_states.pt")["optimizer"]["fp32_groups"]
        mine = [n for (_, g), ns in sorted(names.items()) if g // per_rank == e for n in ns]
        assert len(dense) == len(model["module"]) and len(local) == len(mine)
        for name, master in [*zip(model["module"], dense), *zip(mine, local)]:
            assert name not in held or bits_equal(held[name], master), name  # every rank's dense masters agree
            held[name] = master
    return held


@pytest.mark.parametrize("name", CASES)
def test_a_stage0_moe_job_resumes_the_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    assert {s for r in target for s in r["source"].values()} == {HELD_BY[spec["dtype"]]}
    assert union_of([r["master"] for r in target]) == {}  # DeepSpeed's getter does not answer at stage 0
    masters, expected = _file_masters(_tag_dir(entry / "resharded"), spec), _source_masters(ds, source)
    assert masters.keys() == expected.keys() and any("deepspeed_experts" in n for n in masters)
    assert [n for n, master in expected.items() if not bits_equal(masters[n], master)] == []
    check_same_moments_and_step(target, before, masters)
    check_moe_groups_and_logits(target, before, spec, source_spec(source))


def _native(name: str) -> str | None:
    """DeepSpeed's own stage-0 save of the target's dtype, expert degree and experts per layer, if the harness has
    one (``moe-ep2-s0-*``: as many experts as ranks)."""
    _, _, spec = reshard_target(name)
    native = f"moe-ep{spec['ep']}-s0-{spec['dtype']}-ws{spec['experts']}"
    return native if native in PARALLEL_SPECS else None


@pytest.mark.parametrize("name", [n for n in CASES if _native(n)])
def test_the_files_have_the_shape_of_a_real_stage0_moe_save(name, ds):
    """The same files, and in each the same entries in the same order, tensor dtypes and shapes and other values as
    DeepSpeed's own stage-0 MoE save of the same model; only the world size it recorded differs."""
    _, world_size, _ = reshard_target(name)
    ours, theirs = _tag_dir(ds.path(name) / "resharded"), _tag_dir(ds.path(_native(name)))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert list(mine) == list(native), file
        differ = {k for k in mine if mine[k] != native[k]}
        assert differ <= {"/dp_world_size"}, (file, {k: (mine[k], native[k]) for k in differ})
        if file == "mp_rank_00_model_states.pt":
            assert mine["/dp_world_size"] == world_size and mine["/ds_config/zero_optimization/stage"] == 0


@pytest.mark.parametrize("name", CASES)
def test_the_stage0_moe_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a stage-0 MoE at the target world size and expert degree, the same whole model and
    optimizer state (a stage-0 checkpoint's optimizer metadata records no loss scaler or clip_grad)."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert before.kind == after.kind == Kind.MOE
    assert {d.configured_zero_stage for d in after.domains} == {0}
    assert after.index.topology.degrees.data == world_size and after.index.topology.degrees.expert == spec["ep"]
    check_same_to_ckptspec(before, after, optimizer_keys=("class", "groups"), expert_group_name=f"ep_size_{spec['ep']}")
