"""#40: ``ckptspec export-universal`` of tensor-parallel (AutoTP) ZeRO-1/2/3, pipeline (``PipelineModule``) and MoE
ZeRO-1/2 checkpoints, side by side with DeepSpeed's own ``ds_to_universal`` folder of the same source (which fails on
MoE); a pipeline with a ``TiedLayerSpec`` on both stages, a frozen weight and a buffer among them. A stage-0 MoE's
folder: test_reshard_moe_stage0.py.

Ground truth: a real DeepSpeed job of the target layout (``scenarios.UNIVERSAL_PARALLEL`` and ``UNIVERSAL_MOE``,
tests/_harness/optim_job.py) loads ckptspec's folder with ``checkpoint.load_universal: true`` and records, on every
rank, the fp32 masters (``safe_get_full_fp32_param``), the Adam moments (``safe_get_full_optimizer_state``), the
step, the param groups and the logits of a fixed batch; the tensor/pipeline-parallel jobs then load DeepSpeed's
folder of the same source too (``universal.rank<R>.pt``). The source's own "+optim" entry is what a job of the
source's layout holds after loading the source itself.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from _harness.before_load import noise
from _harness.parallel_oracles import affine_pieces, bits_equal, info, logits_of, optim_records, shard_of, union_of
from _harness.scenarios import (
    DEGREE_RESHARDS,
    FUSED_SPECS,
    UNIVERSAL_MOE,
    UNIVERSAL_PARALLEL,
    optim_name,
    reshard_target,
    source_spec,
)
from click.testing import CliRunner

from ckptspec.cli import cli

CASES = sorted(UNIVERSAL_PARALLEL)
MOE_CASES = sorted(UNIVERSAL_MOE)
_EXPERT = re.compile(r"deepspeed_experts\.(\d+)\.")
# ds_to_universal fails on these sources (measured): no folder of DeepSpeed's to compare or load beside ckptspec's. An
# AutoTP frozen parameter left whole (head.bias) is among the replicated patterns the saved universal_checkpoint_info
# lists, and no optimizer partition holds a slice of it.
DS_FAILS = {"tp2-s3-bf16-ws2-extras": r"AssertionError: Unused patterns=['^head\\.bias$'] while merging tp slices"}
# and the AutoTP MLPs of fused weights (gate_up_proj, fused QKV, SubParam layers; their moves:
# tests/export/test_reshard_fused.py, test_reshard_fused_layers.py)
SOURCES = sorted(({DEGREE_RESHARDS[n][0] for n in CASES} | FUSED_SPECS.keys()) - DS_FAILS.keys())
BESIDE = sorted(n for n in CASES if DEGREE_RESHARDS[n][0] not in DS_FAILS)  # the job loaded DeepSpeed's folder too
# AutoTP's row-parallel layer adds the tensor ranks' partial sums, the whole layer all products in one matmul: a tp1
# target's logits are rounded in another order (as test_reshard_tensor.py: 2 epsilons at the largest logit)
LOGITS_EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}


def _held(records: list[dict]) -> dict[tuple[int, str, str], torch.Tensor]:
    """(tensor rank, name, master|exp_avg|exp_avg_sq) -> the value every rank holding it holds (asserted equal)."""
    return union_of(
        [
            {
                (r["coords"].get("tp", 0), name, key): value
                for name, master in r["master"].items()
                for key, value in {"master": master, **r["state"][name]}.items()
            }
            for r in records
        ]
    )


def _tp(spec: dict) -> int:
    return spec.get("tp", 1)


def _in_source_shards(held: dict, before: dict, source_entry, same_degree: bool) -> dict:
    """``held`` keyed as ``before``: at the source's tensor degree as held; a tp1 target's whole tensors cut into the
    source's AutoTP shards by DeepSpeed's own affine pieces (the source's model states)."""
    if same_degree:
        return held
    return {
        (tp, name, key): shard_of(held[(0, name, key)], affine_pieces(source_entry, tp, name), value.shape)
        for (tp, name, key), value in before.items()
    }


@pytest.mark.parametrize("name", CASES)
def test_load_universal_of_ckptspecs_folder_holds_the_source_state_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    assert {r["coords"].get("tp", 0) for r in target} == set(range(_tp(spec)))
    expected = _held(before)
    held = _in_source_shards(_held(target), expected, ds.path(source), _tp(spec) == _tp(source_spec(source)))
    assert held.keys() == expected.keys() and expected
    assert {k for _, _, k in expected} == {"master", "exp_avg", "exp_avg_sq"}
    assert [k for k, v in expected.items() if not bits_equal(held[k], v)] == []
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1 and steps != {0}, steps
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)


@pytest.mark.parametrize("name", CASES)
def test_the_logits_are_the_source_jobs(name, ds):
    """At the source's tensor degree the same forward pass, bit for bit; merged (tp1), within LOGITS_EPS."""
    source, _, spec = reshard_target(name)
    logits, expected = logits_of(optim_records(ds.path(name))), logits_of(optim_records(ds.path(optim_name(source))))
    assert logits.abs().max() > 0 and logits.shape == expected.shape
    if _tp(spec) == _tp(source_spec(source)):
        assert bits_equal(logits, expected)
    else:
        bound = 2 * LOGITS_EPS[spec["dtype"]] * expected.abs().max().item()
        assert (logits - expected).abs().max().item() <= bound, (logits - expected).abs().max()


@pytest.mark.parametrize("name", BESIDE)
def test_deepspeeds_own_folder_loaded_by_the_same_job_holds_the_same_bits(name, ds):
    """Side by side: the same target job loading DeepSpeed's ds_to_universal folder of the same source holds the same
    masters, moments, step, param groups and logits as from ckptspec's, bit for bit."""
    entry = ds.path(name)
    assert json.loads((entry / "optim.json").read_text())["universal_error"] is None
    ours, theirs = optim_records(entry), optim_records(entry, "universal")
    held, deepspeeds = _held(ours), _held(theirs)
    assert held.keys() == deepspeeds.keys() and held
    assert [k for k, v in held.items() if not bits_equal(v, deepspeeds[k])] == []
    assert {s for r in ours for s in r["step"].values()} == {s for r in theirs for s in r["step"].values()}
    assert [r["param_groups"] for r in ours] == [r["param_groups"] for r in theirs]
    assert bits_equal(logits_of(ours), logits_of(theirs))


BUFFERS = ("running", "step_count", "seen")  # the harness models' buffers (job/parallel_models.py)
WITH_MODULE = sorted(n for n in CASES if any(source_spec(DEGREE_RESHARDS[n][0]).get(k) for k in ("frozen", "buffers")))


def _module(records: list[dict]) -> dict[tuple[int, int, str], torch.Tensor]:
    """(tensor rank, stage, local name) -> the tensor: a tied module's buffer is each stage's own."""
    coords = [(r["coords"].get("tp", 0), r["coords"].get("pp", 0)) for r in records]
    return union_of([{(*c, n): t for n, t in r["module"].items()} for c, r in zip(coords, records)])


@pytest.mark.parametrize("name", WITH_MODULE)
def test_neither_folder_gives_the_job_its_buffers_or_frozen_parameters(name, ds):
    """DeepSpeed 0.19.8's ``load_universal`` never reads the module (``_load_checkpoint`` skips
    ``load_module_state_dict``) and restores only what an optimizer trains: from ckptspec's folder and from
    ds_to_universal's alike, every buffer is exactly what the job held before loading (before_load.py's noise), not the
    source's, and every frozen parameter the job's own, kept as built (the source's only by the shared seed)."""
    source, _, _ = reshard_target(name)
    entry = ds.path(name)
    built = _module(optim_records(ds.path(optim_name(source))))
    loads = [optim_records(entry)] + ([optim_records(entry, "universal")] if name in BESIDE else [])
    for records in loads:
        module = _module(records)
        buffers = {k for k in module if k[-1].rsplit(".", 1)[-1] in BUFFERS}
        assert module.keys() == built.keys() and buffers, sorted(module)
        for (*coords, n), t in module.items():
            if (*coords, n) in buffers:
                assert bits_equal(t, noise(n, t)) and not bits_equal(t, built[(*coords, n)]), n
            else:
                assert bits_equal(t, built[(*coords, n)]), n


@pytest.mark.parametrize("source", sorted(DS_FAILS))
def test_ds_to_universal_fails_where_ckptspecs_folder_loads(source, ds):
    """Side by side where DeepSpeed's converter fails: the source job's ds_to_universal raised (measured, recorded by
    the job), so the target job found no folder of DeepSpeed's; the same job loaded ckptspec's folder of the source
    and holds its state bit for bit (the tests above)."""
    outcome = info(ds.path(source))["universal"]
    assert outcome["ok"] is False and outcome["error"] == DS_FAILS[source], outcome
    for name in (n for n in CASES if DEGREE_RESHARDS[n][0] == source):
        outcome = json.loads((ds.path(name) / "optim.json").read_text())
        assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
        assert outcome["universal_error"].endswith("latest_universal does not exist"), outcome


def _load(path):
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("source", SOURCES)
def test_the_folder_is_deepspeeds_file_for_file(source, ds, tmp_path):
    """ckptspec's folder against ds_to_universal's of the same tag: the same files; every zero/<param>/*.pt tensor
    and step bit for bit; the model states copied byte for byte. Two entries differ, neither read by DeepSpeed's
    universal loader (the jobs above hold the same bits from both): an AutoTP parameter's ``cat_dim`` (ckptspec
    writes 0 for every parameter; ds_to_universal writes none where the saved affine map placed the shards, and
    its loader's default is 0), and ``optimizer_state.pt``'s ``group_paddings`` of an AutoTP source (ckptspec: as
    saved, [1] in tp2-s1-fp32-ws2; ds_to_universal: [0], after stripping the padding of the tensors it reads). From
    ZeRO-3 (AutoTP) nothing differs: no ``cat_dim``, no ``step.pt``, rank 0's optimizer state bit for bit."""
    entry = ds.path(source)
    theirs = entry / info(entry)["universal"]["output_folder"]
    ours = tmp_path / "uc"
    result = CliRunner().invoke(cli, ["export-universal", str(entry), str(ours)])
    assert result.exit_code == 0, result.output
    files = sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file())
    # a trainable parameter's folder per name its stages' optimizers train (a pipeline's tie once)
    tag = entry / info(entry)["tag"]
    trained = {n for f in tag.glob("*mp_rank_*_model_states.pt") for g in _load(f)["param_shapes"] for n in g}
    assert {n.split("/")[1] for n in files if n.endswith("/exp_avg.pt")} == trained
    tensor_parallel, stage3 = _tp(source_spec(source)) > 1, source_spec(source)["stage"] == 3
    params = 0
    for name in files:
        if name.endswith("model_states.pt"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        elif name == "zero/optimizer_state.pt" and stage3:
            a, b = _load(ours / name), _load(theirs / name)
            assert list(a) == list(b) and _same(a, b), (list(a), list(b))
        elif name == "zero/optimizer_state.pt":
            a, b = _load(ours / name), _load(theirs / name)
            differ = {k for k in a.keys() | b.keys() if repr(a.get(k)) != repr(b.get(k))}
            assert differ <= ({"group_paddings"} if tensor_parallel else set()), differ
            saved = _load(next(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")))
            assert a["group_paddings"] == saved["optimizer_state_dict"]["group_paddings"]
            assert set(b["group_paddings"]) == {0}
        elif name.endswith("/step.pt"):
            assert _load(ours / name) == _load(theirs / name), name
        else:
            a, b = _load(ours / name), _load(theirs / name)
            assert bits_equal(a.pop("param"), b.pop("param")), name
            assert a == ({} if stage3 else {"cat_dim": 0}), (name, a)
            assert b == ({} if tensor_parallel else {"cat_dim": 0}), (name, b)
            params += 1
    assert params >= 3 * len(trained)


def _same(a, b) -> bool:
    """Nested containers equal, their tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bits_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b)


@pytest.mark.parametrize("name", MOE_CASES)
def test_a_moe_job_loads_ckptspecs_folder_bit_for_bit(name, ds):
    """A MoE job of the same expert-parallel degree and experts per rank (another expert-data-parallel size) loads
    the folder with load_universal: every rank's masters and moments (experts by global name), the step, the param
    groups (the dense and the expert group) and the logits are the source job's, bit for bit."""
    source, world_size, _ = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size
    held, expected = _held(target), _held(before)
    assert held.keys() == expected.keys() and expected
    assert {n for _, n, _ in expected if "deepspeed_experts" in n}, "no expert recorded"
    assert [k for k, v in expected.items() if not bits_equal(held[k], v)] == []
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1 and steps != {0}, steps
    assert len(before[0]["param_groups"]) == 2
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)
    assert bits_equal(logits_of(target), logits_of(before))


@pytest.mark.parametrize("name", MOE_CASES)
def test_a_moe_folder_stacks_each_local_experts_name_over_the_expert_parallel_ranks(name, ds):
    """zero/<local expert name>/ holds, on axis 0, the expert that name stands for on expert-parallel rank 0, 1...
    (global expert r * L + j), as DeepSpeed held it (the source job's record); ``is_expert_param`` and
    ``ep_num_experts`` (the expert-parallel degree) tell DeepSpeed's loader to keep its own rank's. DeepSpeed's
    ds_to_universal fails on the same source (measured)."""
    source, _, _ = reshard_target(name)
    spec = source_spec(source)
    folder = ds.path(name) / "resharded" / "universal" / "zero"
    held = _held(optim_records(ds.path(optim_name(source))))
    per_rank = spec["experts"] // spec["ep"]
    experts = sorted(p.name for p in folder.iterdir() if "deepspeed_experts" in p.name)
    assert experts and all(int(_EXPERT.search(n).group(1)) < per_rank for n in experts)
    for local in experts:
        j = int(_EXPERT.search(local).group(1))
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = _load(folder / local / f"{state}.pt")
            assert saved["is_expert_param"] is True and saved["ep_num_experts"] == spec["ep"], saved.keys()
            assert saved["param"].shape[0] == spec["ep"]
            for r in range(spec["ep"]):
                global_name = _EXPERT.sub(f"deepspeed_experts.{r * per_rank + j}.", local, count=1)
                want = held[(0, global_name, "master" if state == "fp32" else state)]
                assert bits_equal(saved["param"][r], want.float()), (local, state, r)
    outcome = info(ds.path(source))["universal"]
    assert outcome["ok"] is False and outcome["error"].startswith("RuntimeError: shape"), outcome


def test_a_damaged_pipeline_source_is_refused_and_nothing_written(ds, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ds.path("pp2-s1-fp32-ws2"), source, ignore=shutil.ignore_patterns("*_universal"))
    victim = source / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])
    result = CliRunner().invoke(cli, ["export-universal", str(source), str(tmp_path / "out")])
    assert result.exit_code == 1 and "CK205" in result.output, result.output
    assert "zero_pp_rank_0_mp_rank_01_optim_states.pt" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
