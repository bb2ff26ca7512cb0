"""#40: a MoE ZeRO-1/2 checkpoint (``deepspeed.moe.layer.MoE``) resharded to another world size, stage or
expert-parallel degree (``ckptspec reshard --world-size N [--stage S] [--expert-parallel E]``).

Ground truth: a real DeepSpeed job of the same MoE model at the target world size resumes from what ``ckptspec
reshard`` wrote (``engine.load_checkpoint``: tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records every
parameter's fp32 master (``safe_get_full_fp32_param``), Adam moments (``safe_get_full_optimizer_state``), step,
param groups and the logits of a fixed batch, by global name (an expert's on the ranks of its expert-parallel
rank). The source's own job (its ``+optim`` entry) recorded the same after loading the source: every value must be
equal, bit for bit. The target's expert-data-parallel groups differ in size from the source's (ws4 ep2: 2 ranks per
expert group, ws2 ep2: 1, ws2 ep1: 2), and with another expert degree each rank holds other experts under other
local names, so each expert group's partitions are laid out anew as well as the dense group's.
"""

from __future__ import annotations

import json

import pytest
from _harness.parallel_oracles import (
    bits_equal,
    check_moe_groups_and_logits,
    check_same_moments_and_step,
    check_same_to_ckptspec,
    optim_records,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, is_moe_to_stage0, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

# the universal folders: test_universal_parallel.py; from stage 0: test_reshard_moe_stage0.py; to stage 0:
# test_reshard_moe_to_stage0.py
MOE = sorted(
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if source_spec(source).get("ep")
    and source_spec(source)["stage"]
    and not options.get("export_universal")
    and not is_moe_to_stage0(n)  # test_reshard_moe_to_stage0.py
)


@pytest.mark.parametrize("name", MOE)
def test_a_moe_job_resumes_the_resharded_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    masters, expected = union_of([r["master"] for r in target]), union_of([r["master"] for r in before])
    assert masters.keys() == expected.keys() and any("experts" in n for n in masters)
    for n, master in expected.items():
        assert bits_equal(masters[n], master), n
    check_same_moments_and_step(target, before, masters)
    check_moe_groups_and_logits(target, before, spec, source_spec(source))


@pytest.mark.parametrize("name", MOE)
def test_the_resharded_moe_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, MoE at the target world size and stage, the same whole model and optimizer state."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == Kind.MOE and after.index.topology.degrees.data == world_size
    assert after.index.topology.degrees.expert == spec["ep"]
    assert {d.configured_zero_stage for d in after.domains} == {spec["stage"]}
    check_same_to_ckptspec(before, after, expert_group_name=f"ep_size_{spec['ep']}")


@pytest.mark.parametrize(
    "args,says",
    [
        (["--world-size", "3"], "not a multiple of the expert-parallel degree (2)"),
        (["--world-size", "2", "--stage", "3"], "--stage 3 for a MoE checkpoint"),
    ],
)
def test_what_a_moe_reshard_cannot_write_is_refused_by_name(args, says, ds, tmp_path):
    result = CliRunner().invoke(cli, ["reshard", str(ds.path("moe-ep2-s1-bf16-ws4")), str(tmp_path / "out"), *args])
    assert result.exit_code == 1 and "CK410" in result.output and says in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
