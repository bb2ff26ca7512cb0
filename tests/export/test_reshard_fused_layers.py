"""#40: AutoTP's other fused sub-parameter layers, and a fused weight at ZeRO-3, read, merged and split
(scenarios.FUSED_SPECS, FUSED_RESHARDS).

Four sources of the AutoTP training launches (job/parallel_models.py ``fused``):
- ``qkv``: a ``qkv_proj`` Linear in a ``...DecoderLayer`` block, which DeepSpeed 0.19.8's heuristic rules make its
  fused-QKV ``fused_LinearLayer`` (glm layout: each rank holds its part of the q, the k and the v third), fp32 ZeRO-1;
- ``True`` at ZeRO-3 in bf16: the ``gate_up_proj`` model (DeepSpeed's ``GateUpPack_LinearLayer``: gate and up
  halves) of test_reshard_fused.py, in the AutoTP ZeRO-3 launch;
- ``subparam-uneven``: the same model of 30, 17 and 17 rows, which DeepSpeed cuts unevenly over 2 ranks (15/15,
  9/8, 9/8), fp32 ZeRO-1: read and merged; its split refused;
- ``subparam``: by partition_config ``shape`` specs, a column ``SubParamLinearLayer`` of unequal sub-parameters (32,
  16 and 16 rows) and the row-parallel ``SubParamLinearAllreduce`` taking the same three along its input columns
  (pieces along axis 1; its bias replicated), bf16 ZeRO-2.

Ground truth: the saving job's live fp32 masters (``safe_get_full_fp32_param``, each tensor rank's); DeepSpeed's own
gather of the tensor-parallel module (``consolidated.pt``, ``engine._consolidated_16bit_state_dict``: the layers'
``gather_params``; the model dtype: fp32 masters, or the bf16 weights DeepSpeed's step casts from them); the source
loaded at its own layout (``+optim``: moments, step); real jobs at tp1 x dp2 and tp4 x dp1 that loaded what ckptspec
wrote (``engine.load_checkpoint``) and DeepSpeed's ``ds_to_universal`` folder of the source (``load_universal``).
A tensor rank's shard is put together by the layout the model was built with (``LAYOUTS``: the blocks of each fused
tensor along its axis, a rank's shard its part of every block in block order), never by the affine map ckptspec reads;
that rule is checked against DeepSpeed's own gather first.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import (
    assert_same_by_name,
    bits_equal,
    check_same_to_ckptspec,
    optim_records,
    rank_oracles,
)
from _harness.scenarios import FUSED_RESHARDS, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.format.index_models import PiecesPlacement

QKV, SUBPARAM, ZERO3 = "tp2-s1-fp32-ws2-fused-qkv", "tp2-s2-bf16-ws2-fused-subparam", "tp2-s3-bf16-ws2-fused"
UNEVEN = "tp2-s1-fp32-ws2-fused-uneven"
# The fused tensors of each source: name -> (axis, sub-parameter lengths along it), as the model was built.
LAYOUTS = {
    QKV: {f"blocks.{i}.qkv_proj.{kind}": (0, (32, 32, 32)) for i in (0, 1) for kind in ("weight", "bias")},
    SUBPARAM: {
        **{f"blocks.{i}.qkv.{kind}": (0, (32, 16, 16)) for i in (0, 1) for kind in ("weight", "bias")},
        **{f"blocks.{i}.o.weight": (1, (32, 16, 16)) for i in (0, 1)},
    },
    ZERO3: {f"blocks.{i}.gate_up_proj.{kind}": (0, (32, 32)) for i in (0, 1) for kind in ("weight", "bias")},
    UNEVEN: {
        **{f"blocks.{i}.qkv.{kind}": (0, (30, 17, 17)) for i in (0, 1) for kind in ("weight", "bias")},
        **{f"blocks.{i}.o.weight": (1, (30, 17, 17)) for i in (0, 1)},
    },
}
SOURCES = sorted(LAYOUTS)
MOVES = sorted(n for n in FUSED_RESHARDS if FUSED_RESHARDS[n][0] in LAYOUTS)


def _widths(block: int, degree: int) -> list[int]:
    """Each tensor rank's part of a sub-parameter of ``block`` rows: near-equal, the first ranks one more (DeepSpeed
    0.19.8's get_shard_size without a head count or grain: 17 over 2 ranks is 9 and 8)."""
    return [block // degree + (1 if r < block % degree else 0) for r in range(degree)]


def _whole(per_tp: dict[int, dict[str, torch.Tensor]], shapes: dict, fused: dict) -> dict[str, torch.Tensor]:
    """name -> the whole tensor of the tensor ranks' shards (``per_tp``: tensor rank -> name -> shard): a fused
    tensor's shard is its part of each block along its axis, in block order; the rest a replicated copy or a
    column/row block concatenated in rank order along the one axis where it is smaller."""
    ranks = [per_tp[r] for r in sorted(per_tp)]
    out = {}
    for name in ranks[0]:
        shards, shape = [r[name] for r in ranks], tuple(shapes[name])
        if name in fused:
            axis, blocks = fused[name]
            parts = [s.split([_widths(b, len(shards))[r] for b in blocks], dim=axis) for r, s in enumerate(shards)]
            out[name] = torch.cat([p[j] for j in range(len(blocks)) for p in parts], dim=axis)
        elif tuple(shards[0].shape) == shape:
            assert all(bits_equal(s, shards[0]) for s in shards), name
            out[name] = shards[0]
        else:
            (axis,) = [a for a, (n, m) in enumerate(zip(shards[0].shape, shape)) if n != m]
            out[name] = torch.cat(shards, dim=axis)
        assert tuple(out[name].shape) == shape, name
    return out


def _by_tp(records: list[dict], pick) -> dict[int, dict[str, torch.Tensor]]:
    """tensor rank -> name -> value (every data rank of a tensor rank holds the same, bit for bit)."""
    out: dict[int, dict] = {}
    for record in records:
        mine = out.setdefault(record["coords"].get("tp", 0), {})
        for name, value in pick(record).items():
            assert bits_equal(mine.setdefault(name, value), value), (name, record["coords"])
    return out


def _shapes(ds, source: str) -> dict:
    return json.loads((ds.path(source) / "parallel.json").read_text())["global_shapes"]


def _source_masters(ds, source: str) -> dict[str, torch.Tensor]:
    """The saving job's live masters, each tensor rank's put together; checked against DeepSpeed's own gather (the
    module's weights: the masters, or in bf16 the masters cast, as DeepSpeed's step writes them)."""
    oracles = rank_oracles(ds.path(source))
    per_tp = {o["coords"]["tp"]: {o["params"][n]["global_name"]: m for n, m in o["masters"].items()} for o in oracles}
    whole = _whole(per_tp, _shapes(ds, source), LAYOUTS[source])
    consolidated = torch.load(ds.path(source) / "consolidated.pt", weights_only=False)
    assert sorted(consolidated) == sorted(whole)
    for name, value in whole.items():
        assert bits_equal(consolidated[name], value.to(consolidated[name].dtype)), name
    return whole


def _held_whole(ds, source: str, entry: str, prefix: str = "optim") -> dict[str, dict[str, torch.Tensor]]:
    """ "master"/"exp_avg"/"exp_avg_sq" -> name -> whole tensor, as the job of ``entry`` holds them."""
    records, shapes, fused = optim_records(ds.path(entry), prefix), _shapes(ds, source), LAYOUTS[source]
    out = {"master": _whole(_by_tp(records, lambda r: r["master"]), shapes, fused)}
    for key in ("exp_avg", "exp_avg_sq"):
        picked = _by_tp(records, lambda r, key=key: {n: s[key] for n, s in r["state"].items()})
        out[key] = _whole(picked, shapes, fused)
    return out


def _uc_info(tag, tp: int, stage: int) -> dict:
    """Tensor rank ``tp``'s saved ``universal_checkpoint_info`` (ZeRO-3 names its model states per data rank)."""
    prefix = "zero_pp_rank_0_" if stage == 3 else ""
    states = torch.load(tag / f"{prefix}mp_rank_{tp:02d}_model_states.pt", weights_only=False)
    return states["universal_checkpoint_info"]


def _steps(records: list[dict]) -> set:
    return {s for r in records for s in r["step"].values()}


@pytest.mark.parametrize("source", SOURCES)
def test_deepspeed_cut_each_fused_tensor_in_one_piece_per_sub_parameter(source, ds):
    """What the harness claims of its sources: DeepSpeed's affine_map holds one piece per sub-parameter on each
    tensor rank, along the fused tensor's axis, at the offsets of the model's layout; its sub-parameter patterns and
    widths say the same; ckptspec's index keeps them as pieces."""
    tag = ds.path(source) / "global_step2"
    for tp in (0, 1):
        info = _uc_info(tag, tp, source_spec(source)["stage"])
        for name, (axis, blocks) in LAYOUTS[source].items():
            pattern = "^" + name.replace(".", r"\.") + "$"
            pieces = info["affine_map"]["params"][pattern]["ranks"][tp]["pieces"]
            whole = _shapes(ds, source)[name]
            stride = 1 if axis == len(whole) - 1 else whole[-1]
            starts = [sum(blocks[:j]) + sum(_widths(b, 2)[:tp]) for j, b in enumerate(blocks)]
            assert [p["source"][0] for p in pieces] == [s * stride for s in starts], (name, pieces)
            assert [p["shape"][axis] for p in pieces] == [_widths(b, 2)[tp] for b in blocks], name
            assert any(pattern in s["patterns"] for s in info["parameter_with_sub_params"]), name
            assert info["sub_param_shard_widths"][pattern] == [_widths(b, 2) for b in blocks], name
    index = ckptspec.open(ds.path(source)).index
    placements = {p.name: [s.placement for s in p.shards] for p in index.parameters}
    for name, (_, blocks) in LAYOUTS[source].items():
        assert all(isinstance(p, PiecesPlacement) and len(p.pieces) == len(blocks) for p in placements[name]), name


@pytest.mark.parametrize("source", SOURCES)
def test_the_source_validates_and_reconstructs_to_the_jobs_masters(source, ds, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    assert CliRunner().invoke(cli, ["validate", str(ds.path(source))]).exit_code == 0
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reconstruct", str(ds.path(source)), str(out), "--optimizer-state"])
    assert result.exit_code == 0, result.output
    written, masters = load_file(out / "model.safetensors"), _source_masters(ds, source)
    assert sorted(written) == sorted(masters)
    for name, value in masters.items():
        assert bits_equal(written[name], value), name
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        states = json.loads(f.metadata()["ckptspec.states"])
        state = {k: f.get_tensor(k) for k in f.keys()}
    held = _held_whole(ds, source, optim_name(source))
    assert all(bits_equal(v, masters[n]) for n, v in held["master"].items())
    for name in LAYOUTS[source]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(state[states[name][key]], held[key][name]), (name, key)


@pytest.mark.parametrize("name", MOVES)
def test_merged_and_split_checkpoints_are_resumed_bit_for_bit(name, ds):
    """tp2 -> tp1 x dp2 and tp2 -> tp4 x dp1: the masters and both moments the target job holds, put together, are
    the source's; step and param groups the same; the written folder valid and the same to ckptspec. The same job
    loading DeepSpeed's own ds_to_universal folder of the source holds the same bits."""
    source, world_size, spec = reshard_target(name)
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    expected, before = _held_whole(ds, source, optim_name(source)), optim_records(ds.path(optim_name(source)))
    target = optim_records(ds.path(name))
    assert len(target) == world_size and {r["coords"].get("tp", 0) for r in target} == set(range(spec["tp"]))
    assert_same_by_name(_held_whole(ds, source, name), expected, name)
    assert _steps(target) == _steps(before) and len(_steps(before)) == 1
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    check_same_to_ckptspec(ckptspec.open(ds.path(source)), ckptspec.open(out))
    assert outcome["universal_error"] is None, outcome
    assert_same_by_name(_held_whole(ds, source, name, "universal"), expected, f"{name}: DeepSpeed's folder")


@pytest.mark.parametrize("name", MOVES)
def test_the_logits_are_the_source_jobs_within_the_reduction_bound(name, ds):
    """The row-parallel layers sum T partial products where the source summed 2: a different rounding order, bounded
    by T epsilons of the model dtype at the largest logit (test_reshard_tensor.py's bound)."""
    source, _, spec = reshard_target(name)
    logits = optim_records(ds.path(name))[0]["logits"]
    expected = optim_records(ds.path(optim_name(source)))[0]["logits"]
    assert logits.abs().max() > 0 and logits.shape == expected.shape
    eps = torch.finfo(torch.bfloat16 if source_spec(source)["dtype"] == "bf16" else torch.float32).eps
    bound = max(spec["tp"], 2) * eps * expected.abs().max().item()
    assert (logits - expected).abs().max().item() <= bound, (name, (logits - expected).abs().max(), bound)


@pytest.mark.parametrize("name", [n for n in MOVES if n.endswith(">tp4")])
def test_the_split_records_each_rank_one_piece_of_each_sub_parameter(name, ds):
    """The tp4 folder's affine_map and sub-parameter widths, as DeepSpeed's SubParam layers record them at tp4: rank
    r holds the r-th quarter of every sub-parameter, in block order, along the tensor's axis. What does not depend on
    the degree is what DeepSpeed's own layers recorded at tp2: the row-parallel and replicated patterns (a
    SubParamLinearAllreduce weight among the row-parallel ones), each sub-parameter pattern's partition_dim."""
    source = FUSED_RESHARDS[name][0]
    tag = ds.path(name) / "resharded" / "global_step2"
    stage = source_spec(source)["stage"]
    theirs = _uc_info(ds.path(source) / "global_step2", 0, stage)
    for tp in range(4):
        info = _uc_info(tag, tp, stage)
        for key in ("parameter_with_row_parallelism_patterns", "tp_replicated_parameter_patterns"):
            assert sorted(info[key]) == sorted(theirs[key]), key
        dims = {p: s["partition_dim"] for s in info["parameter_with_sub_params"] for p in s["patterns"]}
        assert dims == {p: s["partition_dim"] for s in theirs["parameter_with_sub_params"] for p in s["patterns"]}
        for tensor, (axis, blocks) in LAYOUTS[source].items():
            pattern = "^" + tensor.replace(".", r"\.") + "$"
            whole = _shapes(ds, source)[tensor]
            stride = 1 if axis == len(whole) - 1 else whole[-1]
            pieces = info["affine_map"]["params"][pattern]["ranks"][tp]["pieces"]
            starts = [sum(blocks[:j]) + tp * b // 4 for j, b in enumerate(blocks)]
            assert [p["source"][0] for p in pieces] == [s * stride for s in starts], (tensor, tp)
            assert info["sub_param_shard_widths"][pattern] == [[b // 4] * 4 for b in blocks], tensor


def test_a_split_of_sub_parameters_cut_unevenly_is_refused_by_name(ds, tmp_path):
    """The uneven source (DeepSpeed cut 17 rows as 9 and 8, checked above) is read and merged, but not split: the
    target's widths are DeepSpeed's to choose when the target job builds its layers; CK410 names the fused weight
    before anything is written."""
    out = tmp_path / "out"
    args = ["reshard", str(ds.path(UNEVEN)), str(out), "--world-size", "4", "--tensor-parallel", "4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "CK410" in result.output, result.output
    assert "blocks.0.qkv.weight" in result.output and "cut unevenly" in result.output
    assert not out.exists() or not any(out.iterdir())
