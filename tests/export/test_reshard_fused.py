"""#40: an AutoTP checkpoint whose fused ``gate_up_proj`` DeepSpeed shards as sub-parameters (its heuristic AutoTP
makes it a ``GateUpPack_LinearLayer``: each tensor rank holds its part of the gate half and its part of the up half,
one piece each in the affine_map), read, merged, split and exported (scenarios.FUSED_SPECS, FUSED_RESHARDS).

Ground truth: the saving job's oracles (each tensor rank's live fp32 masters, ``safe_get_full_fp32_param``) and
DeepSpeed's own gather of the tensor-parallel module (``consolidated.pt``, ``engine._consolidated_16bit_state_dict``:
its GateUpPack ``gather_params``; fp32, so the module's weights are the masters); the source loaded at its own
layout (``+optim``: moments, step); real jobs of the target layouts that loaded what ckptspec wrote
(``engine.load_checkpoint``, ``load_universal``) and recorded what they hold. Each tensor rank's shard is put together
by the layout DeepSpeed documents for GateUpPack, not by the affine map ckptspec reads (``_whole``): a fused weight's
shard is its two halves' parts one after the other (the rule is checked against DeepSpeed's own gather first).
"""

from __future__ import annotations

import json

import torch
from _harness.parallel_oracles import (
    assert_same_by_name,
    bits_equal,
    check_same_to_ckptspec,
    optim_records,
    rank_oracles,
)
from _harness.scenarios import FUSED_RESHARDS, optim_name, reshard_target
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.format.index_models import PiecesPlacement

SOURCE = "tp2-s1-fp32-ws2-fused"
FUSED = ("blocks.0.gate_up_proj.weight", "blocks.0.gate_up_proj.bias", "blocks.1.gate_up_proj.weight")


def _whole(per_tp: dict[int, dict[str, torch.Tensor]], shapes: dict) -> dict[str, torch.Tensor]:
    """name -> the whole tensor of tensor ranks' shards (``per_tp``: tensor rank -> name -> shard): a gate_up_proj
    shard is [gate part; up part] along axis 0 (GateUpPack), the rest a replicated copy (the whole shape) or a
    column/row block concatenated in rank order along the one axis where it is smaller."""
    ranks = [per_tp[r] for r in sorted(per_tp)]
    out = {}
    for name in ranks[0]:
        shards, shape = [r[name] for r in ranks], tuple(shapes[name])
        if tuple(shards[0].shape) == shape:
            assert all(bits_equal(s, shards[0]) for s in shards), name
            out[name] = shards[0]
        elif "gate_up_proj" in name:
            halves = [s.chunk(2, dim=0) for s in shards]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            (axis,) = [a for a, (n, m) in enumerate(zip(shards[0].shape, shape)) if n != m]
            out[name] = torch.cat(shards, dim=axis)
    return out


def _by_tp(records: list[dict], pick) -> dict[int, dict[str, torch.Tensor]]:
    """tensor rank -> name -> value (every data rank of a tensor rank holds the same, bit for bit)."""
    out: dict[int, dict] = {}
    for record in records:
        mine = out.setdefault(record["coords"]["tp"], {})
        for name, value in pick(record).items():
            assert bits_equal(mine.setdefault(name, value), value), (name, record["coords"])
    return out


def _shapes(ds) -> dict:
    return json.loads((ds.path(SOURCE) / "parallel.json").read_text())["global_shapes"]


def _source_masters(ds) -> dict[str, torch.Tensor]:
    """The saving job's live masters, each tensor rank's put together; checked against DeepSpeed's own gather."""
    oracles = rank_oracles(ds.path(SOURCE))
    per_tp = {o["coords"]["tp"]: {o["params"][n]["global_name"]: m for n, m in o["masters"].items()} for o in oracles}
    whole = _whole(per_tp, _shapes(ds))
    consolidated = torch.load(ds.path(SOURCE) / "consolidated.pt", weights_only=False)
    assert sorted(consolidated) == sorted(whole)
    for name, value in whole.items():
        assert bits_equal(consolidated[name].float(), value), name
    return whole


def _source_state(ds) -> dict[str, dict[str, torch.Tensor]]:
    """ "master"/"exp_avg"/"exp_avg_sq" -> name -> whole tensor, as the source loaded at its own layout holds them."""
    records, shapes = optim_records(ds.path(optim_name(SOURCE))), _shapes(ds)
    out = {"master": _whole(_by_tp(records, lambda r: r["master"]), shapes)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = _whole(_by_tp(records, lambda r, key=key: {n: s[key] for n, s in r["state"].items()}), shapes)
    return out


def test_deepspeed_made_gate_up_proj_a_sub_parameter_layer_of_two_pieces_per_rank(ds):
    """What the harness claims of its source: two pieces per tensor rank in DeepSpeed's affine_map, its
    sub-parameter patterns, and ckptspec's index keeps them as pieces (no split describes them)."""
    tag = ds.path(SOURCE) / "global_step2"
    for tp in (0, 1):
        info = torch.load(tag / f"mp_rank_{tp:02d}_model_states.pt", weights_only=False)["universal_checkpoint_info"]
        entry = info["affine_map"]["params"][r"^blocks\.0\.gate_up_proj\.weight$"]
        assert entry["logical_shape"] == [64, 16] and len(entry["ranks"][tp]["pieces"]) == 2
        assert [p["source"][0] for p in entry["ranks"][tp]["pieces"]] == [tp * 256, 512 + tp * 256]
        assert any(r"^blocks\.0\.gate_up_proj\.weight$" in s["patterns"] for s in info["parameter_with_sub_params"])
    index = ckptspec.open(ds.path(SOURCE)).index
    placements = {p.name: [s.placement for s in p.shards] for p in index.parameters}
    for name in FUSED:
        assert all(isinstance(p, PiecesPlacement) and len(p.pieces) == 2 for p in placements[name]), name


def test_the_source_validates_and_reconstructs_to_deepspeeds_gathered_masters(ds, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    assert CliRunner().invoke(cli, ["validate", str(ds.path(SOURCE))]).exit_code == 0
    result = CliRunner().invoke(cli, ["reconstruct", str(ds.path(SOURCE)), str(tmp_path / "out"), "--optimizer-state"])
    assert result.exit_code == 0, result.output
    written, masters = load_file(tmp_path / "out" / "model.safetensors"), _source_masters(ds)
    assert sorted(written) == sorted(masters)
    for name, value in masters.items():
        assert bits_equal(written[name], value), name
    with safe_open(tmp_path / "out" / "optimizer.safetensors", "pt") as f:
        states = json.loads(f.metadata()["ckptspec.states"])
        state = {k: f.get_tensor(k) for k in f.keys()}
    held = _source_state(ds)
    for name in FUSED:
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(state[states[name][key]], held[key][name]), (name, key)


def _outcome(ds, name: str) -> dict:
    return json.loads((ds.path(name) / "optim.json").read_text())


def _held_whole(ds, name: str, prefix: str = "optim") -> dict[str, dict[str, torch.Tensor]]:
    records, shapes = optim_records(ds.path(name), prefix), _shapes(ds)
    out = {"master": _whole(_by_tp(records, lambda r: r["master"]), shapes)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = _whole(_by_tp(records, lambda r, key=key: {n: s[key] for n, s in r["state"].items()}), shapes)
    return out


def _steps(records: list[dict]) -> set:
    return {s for r in records for s in r["step"].values()}


def test_merged_and_split_checkpoints_are_resumed_bit_for_bit(ds):
    """tp2 -> tp1 x dp2 and tp2 -> tp4 x dp1: the masters and both moments the target job holds, put together, are
    the source's; step and param groups the same; the written folder valid and the same to ckptspec."""
    expected, before = _source_state(ds), optim_records(ds.path(optim_name(SOURCE)))
    assert all(bits_equal(v, _source_masters(ds)[n]) for n, v in expected["master"].items())
    for name in ("tp2-s1-fp32-ws2-fused>tp1", "tp2-s1-fp32-ws2-fused>tp4"):
        _, world_size, spec = reshard_target(name)
        assert _outcome(ds, name).get("reshard_error") is None, _outcome(ds, name)
        target = optim_records(ds.path(name))
        assert len(target) == world_size and {r["coords"]["tp"] for r in target} == set(range(spec["tp"]))
        assert_same_by_name(_held_whole(ds, name), expected, name)
        assert _steps(target) == _steps(before) and len(_steps(before)) == 1
        assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
        # the row-parallel down_proj now sums T partial products where the source summed 2 (test_reshard_tensor.py)
        logits, expected_logits = target[0]["logits"], before[0]["logits"]
        assert logits.abs().max() > 0 and logits.shape == expected_logits.shape
        bound = max(spec["tp"], 2) * torch.finfo(torch.float32).eps * expected_logits.abs().max().item()
        assert (logits - expected_logits).abs().max().item() <= bound, (name, (logits - expected_logits).abs().max())
        out = ds.path(name) / "resharded"
        assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
        check_same_to_ckptspec(ckptspec.open(ds.path(SOURCE)), ckptspec.open(out))


def test_the_split_records_each_rank_one_piece_of_each_half(ds):
    """The tp4 folder's affine_map, as DeepSpeed's GateUpPack records it at tp4: rank r holds rows [8r, 8r+8) of the
    gate half and of the up half; its sub-parameter patterns and widths too."""
    tag = ds.path("tp2-s1-fp32-ws2-fused>tp4") / "resharded" / "global_step2"
    for tp in range(4):
        info = torch.load(tag / f"mp_rank_{tp:02d}_model_states.pt", weights_only=False)["universal_checkpoint_info"]
        entry = info["affine_map"]["params"][r"^blocks\.0\.gate_up_proj\.weight$"]
        pieces = entry["ranks"][tp]["pieces"]
        assert [(p["shape"], p["source"][0], p["dest"][0]) for p in pieces] == [
            ([8, 16], tp * 128, 0),
            ([8, 16], 512 + tp * 128, 128),
        ]
        assert info["sub_param_shard_widths"][r"^blocks\.0\.gate_up_proj\.weight$"] == [[8] * 4, [8] * 4]


def test_ckptspecs_universal_folder_beside_deepspeeds(ds):
    """ckptspec's export-universal of the source, loaded with load_universal at tp1 and at tp2: the source's masters,
    moments and step. DeepSpeed's own ds_to_universal folder of the same source, loaded by the same jobs (and the tp1
    and tp4 targets): the same, bit for bit."""
    expected = _source_state(ds)
    for name in [n for n, v in FUSED_RESHARDS.items() if v[0] == SOURCE]:  # (the other sources: *_fused_layers.py)
        outcome = _outcome(ds, name)
        assert outcome.get("reshard_error") is None and outcome["universal_error"] is None, outcome
        if "universal" in name:
            assert_same_by_name(_held_whole(ds, name), expected, name)
        assert_same_by_name(_held_whole(ds, name, "universal"), expected, f"{name}: DeepSpeed's folder")
        theirs = optim_records(ds.path(name), "universal")
        assert _steps(theirs) == _steps(optim_records(ds.path(optim_name(SOURCE))))


def test_a_degree_that_does_not_divide_a_sub_parameter_is_refused_by_name(ds, tmp_path):
    """tp2 -> tp3: each half of gate_up_proj (32 rows) cannot be cut in 3; CK410 names the fused weight before
    anything is written."""
    args = ["reshard", str(ds.path(SOURCE)), str(tmp_path / "out"), "--world-size", "3", "--tensor-parallel", "3"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "CK410" in result.output, result.output
    assert "blocks.0.gate_up_proj.weight" in result.output and "sub-parameters of [32, 32]" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
