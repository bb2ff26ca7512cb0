"""The optimizer state export (``reconstruct --optimizer-state``, ``load_optimizer_state``) against the
live engine, on every matrix point.

Oracle: ``live_optim.pt``, recorded in the training job just before saving: each group's flat state
partitions gathered over the ranks and sliced where each param sits in the flat low-precision
buffer (stage 1/2), DeepSpeed's per-param getter at stage 3 (tests/_harness/job/model.py). The
export must equal it bit for bit, every state of every param, and the per-group scalars must be
the live optimizer's.

Where DeepSpeed's own ``safe_get_full_optimizer_state`` stands (recorded in the same job):

* under round robin it returns other parameters' moments, for exactly the parameters whose fp32
  master ``safe_get_full_fp32_param`` gets wrong (its ``_hp_mapping`` ignores the reorder);
* with several param groups at stage 1/2 it raises for every param of every group but the first
  until the links are rebuilt: DeepSpeed links optimizer state to params after stepping group 0 only;
* everywhere else it agrees with the live buffers, so there the export equals it too.
"""

from __future__ import annotations

import json

import pytest
from _harness.scenarios import MATRIX, MATRIX_SPECS
from safetensors import safe_open

import ckptspec
from ckptspec.errors import InvalidCheckpoint
from ckptspec.format.migrate import migrate_document


def _bits_equal(ours, theirs) -> bool:
    import torch

    return (
        ours.dtype == theirs.dtype
        and ours.shape == theirs.shape
        and torch.equal(ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("name", MATRIX)
def test_exported_state_is_the_live_state(ckptspec_cli, name, ds, tmp_path):
    import torch

    save_dir = ds.path(name)
    out = tmp_path / "out"
    result = ckptspec_cli("reconstruct", save_dir, out, "--quiet", "--optimizer-state")
    assert result.output == ""
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.safetensors"]
    live = torch.load(save_dir / "live_optim.pt", weights_only=True)
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        meta = f.metadata()
        exported = {k: f.get_tensor(k) for k in f.keys()}
    aliases = json.loads(meta["ckptspec.aliases"])
    states = json.loads(meta["ckptspec.states"])
    assert live["state"], "the job recorded the live optimizer state"
    for param, by_key in live["state"].items():
        owner = aliases.get(param, param)
        assert set(states[owner]) == set(by_key) == {"exp_avg", "exp_avg_sq"}
        for key, theirs in by_key.items():
            assert _bits_equal(exported[states[owner][key]], theirs), f"{name}: {param}.{key}"
    assert len(exported) == 2 * len({aliases.get(p, p) for p in live["state"]})
    optimizer = json.loads(meta["ckptspec.optimizer"])
    assert {g["optimizer_group"]: g["step"] for g in optimizer["groups"]} == live["steps"]
    for g in optimizer["groups"]:
        settings = {
            k: list(v) if isinstance(v, tuple) else v for k, v in live["param_groups"][g["optimizer_group"]].items()
        }
        assert g["hyperparameters"] == {k: v for k, v in settings.items() if v is not None}


@pytest.mark.parametrize("name", MATRIX)
def test_where_deepspeeds_getter_disagrees(name, ds):
    """Recorded in the job: wrong under round robin (as the fp32 getter), stale for the params of a
    second param group at stage 1/2, right everywhere else."""
    info = json.loads((ds.path(name) / "harness.json").read_text())
    spec, world = MATRIX_SPECS[name]
    fp32_wrong = info["safe_get_full_fp32_param_mismatches"]
    optim_wrong = info["safe_get_full_optimizer_state_mismatches"]
    assert optim_wrong["exp_avg"] == optim_wrong["exp_avg_sq"] == fp32_wrong
    assert bool(fp32_wrong) == (spec.get("round_robin", False) and world > 1)
    if fp32_wrong:
        assert fp32_wrong == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    second_group = ["l1.bias", "l2.bias"] if spec.get("two_groups") and spec["stage"] in (1, 2) else []
    assert info["safe_get_full_optimizer_state_stale"] == second_group


def test_load_optimizer_state_api(ds):
    import torch

    save_dir = ds.path("s3-fp16-ws3-groups")
    state, optimizer = ckptspec.load_optimizer_state(save_dir)
    live = torch.load(save_dir / "live_optim.pt", weights_only=True)
    assert sorted(state) == sorted(live["state"])  # tied aliases included, as in the live model
    for param, by_key in live["state"].items():
        for key, theirs in by_key.items():
            assert _bits_equal(torch.from_numpy(state[param][key]), theirs), (param, key)
    assert optimizer["class"] == "unknown" and [g["optimizer_group"] for g in optimizer["groups"]] == [0, 1]
    assert optimizer["loss_scaler"]["kind"] == "DynamicLossScaler"


def test_a_1_0_manifest_has_no_optimizer_state_to_export(ckptspec_cli, ds, tmp_path):
    """CK402, and nothing written: a 1.0 manifest locates no optimizer state."""
    save_dir = ds.path("s2-bf16-ws2")
    manifest = tmp_path / "m10.json"
    ckptspec_cli("generate", save_dir, "-o", manifest)
    manifest.write_text(json.dumps(migrate_document(json.loads(manifest.read_text()), "1.0").document))
    out = tmp_path / "out"
    from click.testing import CliRunner

    from ckptspec.cli import cli as command

    result = CliRunner().invoke(
        command, ["reconstruct", str(save_dir), str(out), "--quiet", "--optimizer-state", "--manifest", str(manifest)]
    )
    assert result.exit_code == 1 and "CK402 the manifest locates no optimizer state" in result.output
    assert not out.exists()
    with pytest.raises(InvalidCheckpoint) as info:
        ckptspec.load_optimizer_state(save_dir, manifest=manifest)
    assert info.value.code == "CK402"
