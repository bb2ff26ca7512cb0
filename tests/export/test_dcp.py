"""``ckptspec export --format dcp`` against real jobs: DeepSpeed saves, FSDP2 loads (issue #20).

Each DCP source (tests/_harness/scenarios.py ``DCP_SOURCES``: ZeRO-1/2/3, bf16, fp32 and fp16, two
param groups, a tie, a frozen parameter, buffers, round robin, BF16_Optimizer) is exported and
loaded by an FSDP2 job (``fully_shard`` on a CPU mesh, gloo) at world size 1, 2 and 3, the way a user
loads it: ``get_state_dict``, ``dcp.load``, ``set_state_dict`` (tests/_harness/fsdp2_job.py).

Oracles, all recorded by the DeepSpeed job before it saved: the live engine's fp32 masters
(``live_fp32.pt``) and Adam state and step per optimizer group (``live_optim.pt``); the
model-states files read with torch for frozen parameters and buffers. Where DeepSpeed's own
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` are right (everywhere but round
robin, harness.json), they equal those oracles. The extra step is replayed here with plain
``torch.optim.AdamW`` on the consolidated state and the same batch.
"""

from __future__ import annotations

import json

import pytest
from _harness.dcp_oracles import check_plain_load
from _harness.scenarios import DCP_SOURCES, FSDP2_WORLD_SIZES, fsdp2_name


@pytest.mark.parametrize("world_size", FSDP2_WORLD_SIZES)
@pytest.mark.parametrize("source", DCP_SOURCES)
def test_fsdp2_continues_the_deepspeed_run(source, world_size, ds):
    """The oracles of tests/_harness/dcp_oracles.py (``check_plain_load``): masters, frozen parameters, buffers,
    moments, steps and hyperparameters bit for bit; the extra step as plain AdamW's."""
    import torch

    got = torch.load(ds.path(fsdp2_name(source, world_size)) / "fsdp2.pt", weights_only=False)
    check_plain_load(ds, source, world_size, got)


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli as command

    return CliRunner().invoke(command, [str(a) for a in args])


def test_summary_lists_what_dcp_does_not_carry(ds, tmp_path):
    """fp16 at stage 3: the dynamic loss scaler and the counters are named, with their values."""
    result = _run("export", ds.path("s3-fp16-ws3-groups"), tmp_path / "dcp", "--format", "dcp")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'dcp'}: wrote a dcp checkpoint: 25 tensors")
    assert '  not carried: loss scaler: DynamicLossScaler {"consecutive_hysteresis": false' in result.output
    assert '"cur_scale": 16' in result.output
    assert "  not carried: training counters: global_steps=2 global_samples=24 skipped_steps=0" in lines
    assert any(line.startswith("  not carried: optimizer class: not recorded") for line in lines)
    marker = json.loads((tmp_path / "dcp" / "ckptspec-export.json").read_text())
    assert marker["not_carried"] == [line.removeprefix("  not carried: ") for line in lines[1:]]


def test_nothing_written_for_a_checkpoint_with_errors(ds, tmp_path):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ds.path("s2-bf16-ws2"), src)
    victim = next((src / "global_step2").glob("*rank_1*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-100])
    result = _run("export", src, tmp_path / "dcp", "--format", "dcp")
    assert result.exit_code == 1
    assert f"{victim.name}: $.files[2] (rank 1): CK205 zip directory unreadable" in result.output
    assert "not exported: the checkpoint has errors; nothing was written" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_1_0_manifest_locates_no_optimizer_state(ds, tmp_path):
    from ckptspec.format.migrate import migrate_document

    save_dir = ds.path("s2-bf16-ws2")
    manifest = tmp_path / "m.json"
    assert _run("generate", save_dir, "-o", manifest).exit_code == 0
    manifest.write_text(json.dumps(migrate_document(json.loads(manifest.read_text()), "1.0").document))
    result = _run("export", save_dir, tmp_path / "dcp", "--manifest", manifest)
    assert result.exit_code == 1 and "CK402 the manifest locates no optimizer state" in result.output
    assert not (tmp_path / "dcp").exists()


def test_output_is_replaced_only_when_it_is_an_earlier_export(ds, tmp_path):
    save_dir, out = ds.path("s2-bf16-ws2"), tmp_path / "dcp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = _run("export", save_dir, out, "-q")
    assert result.exit_code == 2 and "CK909" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    assert _run("export", save_dir, out, "-q").exit_code == 0  # an empty directory
    first = sorted(p.name for p in out.iterdir())
    assert ".metadata" in first and "ckptspec-export.json" in first
    assert _run("export", save_dir, out, "-q").exit_code == 0  # an earlier export: replaced whole
    assert sorted(p.name for p in out.iterdir()) == first
    assert not [p for p in tmp_path.iterdir() if p.name != "dcp"], "no temporary left beside it"
