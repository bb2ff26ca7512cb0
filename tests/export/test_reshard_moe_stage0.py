"""#40: a MoE checkpoint at ZeRO stage 0 (``deepspeed.moe.layer.MoE``) written as a ZeRO-1/2 MoE checkpoint
(``ckptspec reshard --stage 1|2``, at another world size or expert-parallel degree too), and as DeepSpeed's universal
folder (``export-universal``; DeepSpeed's ``ds_to_universal`` fails on it), loaded with ``load_universal``.

A stage-0 MoE keeps no ZeRO partitions: the dense masters are the module (fp32) or FP16_UnfusedOptimizer's
``fp32_groups`` (bf16), each expert's its expert file (fp32) or its expert-parallel rank's ``expp_rank`` optimizer
file (bf16), the moments beside them in the torch optimizer's per-parameter state.

Ground truth: a real DeepSpeed MoE job at the target stage, world size and expert degree resumes from what ckptspec
wrote (``engine.load_checkpoint``, or ``load_universal``: tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and
records every parameter's fp32 master (``safe_get_full_fp32_param``), Adam moments (``safe_get_full_optimizer_state``),
step, param groups and the logits of a fixed batch, by global name. DeepSpeed's getters do not answer at stage 0, so
the masters are compared with those the stage-0 job held when it saved (its oracle: the fp32 module, or
``fp32_groups``), and the moments, step, param groups and logits with what the stage-0 job of the source's layout
held after loading the source (its ``+optim`` entry, read from the torch optimizer): every value equal, bit for bit.
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
    info,
    optim_records,
    rank_oracles,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, is_moe_to_stage0, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

CASES = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source).get("ep") and source_spec(source)["stage"] == 0 and not is_moe_to_stage0(n)
)
VIA_UNIVERSAL = {n for n in CASES if DEGREE_RESHARDS[n][3].get("export_universal")}
_EXPERT = re.compile(r"deepspeed_experts\.(\d+)\.")


def _saved_masters(source) -> dict:
    """Global name -> the fp32 master the stage-0 job held when it saved (every rank's oracle, local names)."""
    return union_of([{o["params"][n]["global_name"]: m for n, m in o["masters"].items()} for o in rank_oracles(source)])


@pytest.mark.parametrize("name", CASES)
def test_a_zero_moe_job_resumes_the_stage0_moe_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome.get("load_checkpoint_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and len(before) == info(ds.path(source))["world_size"]
    masters, expected = union_of([r["master"] for r in target]), _saved_masters(ds.path(source))
    assert masters.keys() == expected.keys() and any("deepspeed_experts" in n for n in masters)
    assert union_of([r["master"] for r in before]) == {}  # DeepSpeed's getter does not answer at stage 0
    assert [n for n, master in expected.items() if not bits_equal(masters[n], master)] == []
    check_same_moments_and_step(target, before, masters)
    check_moe_groups_and_logits(target, before, spec, source_spec(source))


@pytest.mark.parametrize("name", sorted(set(CASES) - VIA_UNIVERSAL))
def test_the_zero_moe_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a MoE at the target stage, world size and expert degree, the same whole model and
    optimizer state (a ZeRO file pickles a static unit loss scaler where the fp32 stage-0 optimizer saves none)."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert before.kind == after.kind == Kind.MOE
    assert {d.configured_zero_stage for d in before.domains} == {0}
    assert {d.configured_zero_stage for d in after.domains} == {spec["stage"]}
    assert after.index.topology.degrees.data == world_size and after.index.topology.degrees.expert == spec["ep"]
    check_same_to_ckptspec(before, after, unit_scaler_added=True, expert_group_name=f"ep_size_{spec['ep']}")


@pytest.mark.parametrize("name", sorted(VIA_UNIVERSAL))
def test_the_folder_stacks_each_local_experts_name_over_the_expert_parallel_ranks(name, ds):
    """zero/<local expert name>/ holds, on axis 0, the expert that name stands for on expert-parallel rank 0, 1...
    (global expert r * L + j): its master as the stage-0 job held it, its moments as the job loading the source did;
    DeepSpeed's own ds_to_universal failed on the same source (run by the saving job): it reads ZeRO files."""
    source, _, _ = reshard_target(name)
    spec = source_spec(source)
    folder = ds.path(name) / "resharded" / "universal" / "zero"
    masters = _saved_masters(ds.path(source))
    moments = union_of(
        [
            {(n, k): v for n, s in r["state"].items() for k, v in s.items()}
            for r in optim_records(ds.path(optim_name(source)))
        ]
    )
    per_rank = spec["experts"] // spec["ep"]
    experts = sorted(p.name for p in folder.iterdir() if "deepspeed_experts" in p.name)
    assert {int(_EXPERT.search(n).group(1)) for n in experts} == set(range(per_rank))
    for local in experts:
        j = int(_EXPERT.search(local).group(1))
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(folder / local / f"{state}.pt", weights_only=False)
            assert saved["is_expert_param"] is True and saved["ep_num_experts"] == spec["ep"], saved.keys()
            assert saved["param"].shape[0] == spec["ep"]
            for r in range(spec["ep"]):
                global_name = _EXPERT.sub(f"deepspeed_experts.{r * per_rank + j}.", local, count=1)
                want = masters[global_name] if state == "fp32" else moments[(global_name, state)]
                assert bits_equal(saved["param"][r], want.float()), (local, state, r)
    outcome = info(ds.path(source))["universal"]
    assert outcome["ok"] is False and outcome["error"] == "KeyError: 'optimizer_state_dict'", outcome


@pytest.mark.parametrize(
    "args,says",
    [
        (["--world-size", "2", "--stage", "3"], "--stage 3 for a MoE checkpoint"),
        (["--world-size", "3", "--stage", "1"], "not a multiple of the expert-parallel degree (2)"),
    ],
)
def test_what_a_stage0_moe_reshard_cannot_write_is_refused_by_name(args, says, ds, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reshard", str(ds.path("moe-ep2-s0-bf16-ws2")), str(out), *args])
    assert result.exit_code == 1 and "CK410" in result.output and says in result.output, result.output
    assert not out.exists() or not any(out.iterdir())
