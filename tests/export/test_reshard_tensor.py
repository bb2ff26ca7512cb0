"""#40: an AutoTP checkpoint merged for a job without tensor parallelism (``reshard --tensor-parallel 1``), or split
over more tensor ranks (``reshard --tensor-parallel T``: tp2 -> tp4, by the source's AutoTP rules).

Ground truth: a real DeepSpeed job of the same MLP without AutoTP, at the target world size and stage, resumes
from what ``ckptspec reshard`` wrote (``engine.load_checkpoint``: tests/_harness/optim_job.py,
``DEGREE_RESHARDS``) and records the fp32 masters (``safe_get_full_fp32_param``), Adam moments
(``safe_get_full_optimizer_state``), step, frozen parameters, buffers and the logits of a fixed batch. The
source's own job (its ``+optim`` entry) recorded the same per tensor rank; the test puts each tensor's shards
together itself: a shard the size of the whole tensor is a replicated copy (every rank's must be equal), else the
shards are concatenated, in tensor-rank order, along the one axis where they are smaller (AutoTP's column split
is axis 0, its row split axis 1). Where DeepSpeed's own path can make the move (its ``ds_to_universal`` folder of
the source, loaded with ``load_universal``), the same job recorded what it holds then: both must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import check_same_to_ckptspec, merged, optim_records
from _harness.scenarios import DEGREE_RESHARDS, UNIVERSAL_TOO, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

# a merge for a stage-0 job: test_reshard_stage0.py, and of a stage-0 source: test_reshard_from_autotp_stage0.py
# (DeepSpeed's getters give no masters at stage 0)
MERGES = sorted(
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if options.get("tensor_parallel") == 1 and options.get("stage") != 0 and source_spec(source)["stage"] != 0
)
SPLITS = sorted(
    n
    for n, (source, _, _, options) in DEGREE_RESHARDS.items()
    if options.get("tensor_parallel", 1) > 1 and options.get("stage") != 0 and source_spec(source)["stage"] != 0
)
# The logits of the merged model against the tensor-parallel one: AutoTP's row-parallel layer sums the two tensor
# ranks' partial products (an all-reduce) where the whole layer sums all products in one matmul, so the float sums
# are rounded in another order. The bound: twice the dtype's epsilon at the largest logit (measured: one unit in
# the last place, 6e-8 in fp32 and 0.0039 in bf16 at logits below 1).
LOGITS_EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _held(records: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """The target job's values (every data rank holds the same whole tensors): name -> master, moments."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for record in records:
        for name, master in record["master"].items():
            value = {"master": master, **record["state"][name]}
            seen = out.setdefault(name, value)
            assert all(_equal(seen[k], v) for k, v in value.items()), name
    return out


@pytest.mark.parametrize("name", MERGES)
def test_a_job_without_tensor_parallelism_resumes_the_merged_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and {r["coords"]["tp"] for r in before} == {0, 1}
    assert {r["coords"]["mp_world_size"] for r in target} == {1}
    held = _held(target)
    shapes = {n: tuple(v["master"].shape) for n, v in held.items()}
    masters = merged(before, lambda r: r["master"], shapes)
    assert masters.keys() == held.keys() and held
    for key in ("exp_avg", "exp_avg_sq"):
        moments = merged(before, lambda r, key=key: {n: s[key] for n, s in r["state"].items()}, shapes)
        for n, value in held.items():
            assert _equal(value[key], moments[n]), (n, key)
    for n, value in held.items():
        assert _equal(value["master"], masters[n]), n
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1, steps
    assert target[0]["param_groups"] == before[0]["param_groups"]


@pytest.mark.parametrize("name", MERGES)
def test_frozen_parameters_buffers_and_logits_carry_over(name, ds):
    """The module's frozen parameters and buffers as loaded equal the source's, merged; the logits of a fixed
    batch equal the tensor-parallel model's within LOGITS_EPS (and are not all zero)."""
    source, _, spec = reshard_target(name)
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    module = target[0]["module"]
    assert all(_equal(r["module"][n], t) for r in target for n, t in module.items())
    whole = merged(before, lambda r: r["module"], {n: tuple(t.shape) for n, t in module.items()})
    assert whole.keys() == module.keys()
    for n, t in module.items():
        assert _equal(t, whole[n]), n
    if spec.get("frozen") or spec.get("buffers"):
        assert module, "the spec has frozen parameters or buffers: none recorded"
    logits, expected = target[0]["logits"], before[0]["logits"]
    assert logits.abs().max() > 0 and logits.shape == expected.shape
    bound = 2 * LOGITS_EPS[spec["dtype"]] * expected.abs().max().item()
    assert (logits - expected).abs().max().item() <= bound, (logits - expected).abs().max()


ZERO3_MERGES = [n for n in MERGES if reshard_target(n)[2].get("stage") == 3]


@pytest.mark.parametrize("name", ZERO3_MERGES)
def test_deepspeeds_zero_to_fp32_reads_the_merged_zero3_checkpoint_as_the_job_holds_it(name, ds):
    """DeepSpeed's own reader of ZeRO-3 files (``zero_to_fp32``, which reads ``frozen_param_shapes`` where the load
    does not): every master the target job holds, every frozen parameter and buffer as it loaded them, bit for bit."""
    from _harness.oracles import zero_to_fp32

    target = optim_records(ds.path(name))
    read = zero_to_fp32(ds.path(name) / "resharded")
    held, module = _held(target), target[0]["module"]
    assert sorted(read) == sorted({*held, *module}), sorted(read)
    for n, value in held.items():
        assert _equal(read[n], value["master"]), n
    for n, tensor in module.items():
        assert _equal(read[n], tensor), n


@pytest.mark.parametrize("name", sorted(UNIVERSAL_TOO))
def test_deepspeeds_universal_path_to_the_same_layout_holds_the_same(name, ds):
    """DeepSpeed's own move (ds_to_universal, then load_universal into the same target job): the same masters,
    moments, step and logits, bit for bit."""
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome["universal_error"] is None, outcome
    ours, theirs = optim_records(entry), optim_records(entry, "universal")
    held, universal = _held(ours), _held(theirs)
    assert held.keys() == universal.keys() and held
    for n, value in held.items():
        for key, tensor in value.items():
            assert _equal(tensor, universal[n][key]), (n, key)
    assert {s for r in theirs for s in r["step"].values()} == {s for r in ours for s in r["step"].values()}
    assert _equal(ours[0]["logits"], theirs[0]["logits"])


@pytest.mark.parametrize("name", MERGES)
def test_the_merged_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, one data-parallel domain, the same whole model and optimizer state."""
    source, world_size, _ = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == Kind.ZERO and len(after.domains) == 1
    assert after.index.topology.degrees.data == world_size and after.index.topology.degrees.tensor == 1
    check_same_to_ckptspec(before, after)


def _whole_shapes(ds, source: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's whole shape, as a job without tensor parallelism holds it: the source's own (tp 1) or the
    one that loaded the source's merge."""
    if source_spec(source).get("tp", 1) == 1:
        records = optim_records(ds.path(optim_name(source)))
    else:
        records = optim_records(ds.path(next(n for n in MERGES if DEGREE_RESHARDS[n][0] == source)))
    shapes = {n: tuple(v["master"].shape) for n, v in _held(records).items()}
    return {**shapes, **{n: tuple(t.shape) for n, t in records[0]["module"].items()}}


@pytest.mark.parametrize("name", SPLITS)
def test_a_job_of_more_tensor_ranks_resumes_the_split_checkpoint_bit_for_bit(name, ds):
    """tp2 -> tp4, tp1 -> tp2 (by the target's ds_config): every tensor rank's masters, moments, frozen parameters
    and buffers, put together, are the source's put together; step and param groups the same. Logits: the
    row-parallel layers now sum T partial products (an all-reduce) where the source summed another number, so the
    bound is T epsilons at the largest logit (measured at T = 4: 1.8e-7 in fp32 at logits up to 0.87, 0.0022 in
    bf16 at 0.95)."""
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and {r["coords"]["tp"] for r in target} == set(range(spec["tp"]))
    assert {r["coords"]["mp_world_size"] for r in target} == {spec["tp"]}
    shapes = _whole_shapes(ds, source)
    picks = {
        "master": lambda r: r["master"],
        "exp_avg": lambda r: {n: s["exp_avg"] for n, s in r["state"].items()},
        "exp_avg_sq": lambda r: {n: s["exp_avg_sq"] for n, s in r["state"].items()},
        "module": lambda r: r["module"],
    }
    for what, pick in picks.items():
        got, expected = merged(target, pick, shapes), merged(before, pick, shapes)
        assert got.keys() == expected.keys() and (got or what == "module"), what
        for n, value in expected.items():
            assert _equal(got[n], value), (what, n)
    if spec.get("frozen") or spec.get("buffers"):
        assert merged(target, picks["module"], shapes), "the spec has frozen parameters or buffers: none recorded"
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1, steps
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    logits, expected = target[0]["logits"], before[0]["logits"]
    assert logits.abs().max() > 0 and logits.shape == expected.shape
    bound = spec["tp"] * LOGITS_EPS[spec["dtype"]] * expected.abs().max().item()
    assert (logits - expected).abs().max().item() <= bound, (logits - expected).abs().max()


@pytest.mark.parametrize("name", SPLITS)
def test_the_split_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files (its affine_map describes the new shards), T tensor ranks, the same whole model and
    optimizer state (but ``clip_grad``, which ZeRO-3 files do not save, from a ZeRO-1/2 source to a ZeRO-3 target)."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    assert after.kind == Kind.MODEL_PARALLEL and after.index.topology.degrees.tensor == spec["tp"]
    assert after.index.topology.degrees.data == world_size // spec["tp"]
    assert {d.manifest.layout.zero_stage for d in after.index.domains} == {spec["stage"]}
    to_zero3 = spec["stage"] == 3 and source_spec(source)["stage"] != 3
    check_same_to_ckptspec(before, after, optimizer_keys=("class", "groups", "loss_scaler") if to_zero3 else None)


@pytest.mark.parametrize(
    "config,says",
    [
        (None, "needs the target's AutoTP rules"),
        ({"tensor_parallel": {"autotp_size": 2}}, "needs the target's AutoTP rules"),  # DeepSpeed's presets
        (
            {
                "tensor_parallel": {
                    "partition_config": {
                        "use_default_specs": False,
                        "layer_specs": [
                            {"patterns": [".*\\.down\\.weight$"], "partition_type": "row", "shape": [2, -1]}
                        ],
                    }
                }
            },
            "a layer spec with ['shape'] is not read yet",
        ),
        (
            {
                "tensor_parallel": {
                    "partition_config": {
                        "use_default_specs": False,
                        "layer_specs": [{"patterns": [".*\\.up\\.weight$"], "partition_type": "column"}],
                    }
                }
            },
            "not a multiple of --tensor-parallel 3",
        ),
    ],
)
def test_splitting_a_data_parallel_checkpoint_without_usable_rules_is_refused_by_name(config, says, ds, tmp_path):
    """tp1 -> tp3 by what the target's ds_config says, or nothing: refused before anything is written (CK410)."""
    args = ["reshard", str(ds.path("dense-s2-fp32-ws2")), str(tmp_path / "out"), "--world-size", "3"]
    args += ["--tensor-parallel", "3"]
    if config is not None:
        (tmp_path / "ds_config.json").write_text(json.dumps(config))
        args += ["--ds-config", str(tmp_path / "ds_config.json")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and "CK410" in result.output and says in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_ds_config_that_is_not_json_is_a_usage_error(ds, tmp_path):
    (tmp_path / "ds_config.json").write_text("{not json")
    args = ["reshard", str(ds.path("dense-s2-fp32-ws2")), str(tmp_path / "out"), "--world-size", "2"]
    result = CliRunner().invoke(cli, [*args, "--tensor-parallel", "2", "--ds-config", str(tmp_path / "ds_config.json")])
    assert result.exit_code == 2 and "--ds-config" in result.output and "not JSON" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
