"""#40: an AutoTP checkpoint saved at ZeRO stage 0 (one ``mp_rank_XX_model_states.pt`` per tensor rank, each with its
own copy of the buffers) written as ZeRO-1/2 (``reshard --stage 1|2``, export/reshard_tensor_stage0.py): at its
tensor degree, merged (``--tensor-parallel 1``), split (``--tensor-parallel 4``); and as DeepSpeed's universal folder
(``export-universal``), which DeepSpeed's own ``ds_to_universal`` cannot write from it.

Ground truth: a real DeepSpeed job of the target layout resumes from what ckptspec wrote (``engine.load_checkpoint``,
or ``load_universal`` for the folder: tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records the fp32 masters
(``safe_get_full_fp32_param``), Adam moments, step, param groups, buffers and the logits of a fixed batch. The
stage-0 job answers no getter (no fragment mapping), so the masters are compared with the ones the source job held
when it saved (its oracle, ``FP16_UnfusedOptimizer.fp32_groups`` per tensor rank), the rest with what a stage-0 job
of the source's layout holds after loading the source (its ``+optim`` entry). Each side's tensor shards are put
together by ``parallel_oracles.merged``, by the whole shapes the source job recorded.
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import (
    bits_equal,
    check_same_to_ckptspec,
    info,
    logits_of,
    merged,
    optim_records,
    rank_oracles,
    shape_of,
    union_of,
)
from _harness.scenarios import DEGREE_RESHARDS, optim_name, reshard_target, source_spec
from click.testing import CliRunner

import ckptspec
from ckptspec.checkpoint.embedded import CLIENT_STATE_KEY
from ckptspec.cli import cli
from ckptspec.deepspeed.kinds import Kind

MOVES = sorted(  # to ZeRO (for a stage-0 job: test_reshard_autotp_stage0_world.py)
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source)["stage"] == 0 and source_spec(source).get("tp", 1) > 1 and reshard_target(n)[2]["stage"]
)
VIA_UNIVERSAL = {n for n in MOVES if DEGREE_RESHARDS[n][3].get("export_universal")}
SOURCE = "tp2-s0-bf16-ws2-buffers"
# with a frozen weight AutoTP splits and a frozen bias it leaves whole (named by the masters' shapes), whole shapes
FROZEN_SOURCE, FROZEN = "tp2-s0-bf16-ws2-frozen", {"blocks.0.up.weight": (32, 16), "head.bias": (5,)}
KEYS = ("exp_avg", "exp_avg_sq")


def _shapes(ds, source: str) -> dict[str, tuple[int, ...]]:
    return {n: tuple(shape) for n, shape in info(ds.path(source))["global_shapes"].items()}


def _state(records: list[dict], key: str, shapes) -> dict:
    return merged(records, lambda r: {n: s[key] for n, s in r["state"].items()}, shapes)


def test_the_moves_are_registered():
    assert len(MOVES) == 12 and len(VIA_UNIVERSAL) == 2
    assert {DEGREE_RESHARDS[n][0] for n in MOVES} == {SOURCE, FROZEN_SOURCE}


@pytest.mark.parametrize("name", MOVES)
def test_the_target_job_holds_the_stage0_masters_moments_and_step_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and {r["coords"]["tp"] for r in before} == {0, 1}
    assert {r["coords"].get("tp", 0) for r in target} == set(range(spec.get("tp", 1)))
    shapes = {n: s for n, s in _shapes(ds, source).items() if source != FROZEN_SOURCE or n not in FROZEN}  # trained
    masters = merged(target, lambda r: r["master"], shapes)
    # what the stage-0 job held when it saved (the getter answers None at stage 0, after loading too)
    expected = merged(rank_oracles(ds.path(source)), lambda o: o["masters"], shapes)
    assert masters.keys() == expected.keys() == shapes.keys() and not any(r["master"] for r in before)
    for n, master in masters.items():
        assert bits_equal(master, expected[n]), n
    for key in KEYS:
        held, loaded = _state(target, key, shapes), _state(before, key, shapes)
        assert held.keys() == loaded.keys() == shapes.keys()
        for n, value in loaded.items():
            assert bits_equal(held[n], value), (n, key)
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1 and steps != {0}, steps
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)


@pytest.mark.parametrize("name", MOVES)
def test_buffers_and_logits_carry_over(name, ds):
    """Every rank's buffers as loaded are the source's (each tensor rank's file held its own copy); through the
    universal folder they are the job's own (DeepSpeed's universal load never reads the module: docs/reshard.md).
    The logits of a fixed batch: bit for bit at the source's tensor degree, else within one bf16 epsilon per tensor
    rank of the larger degree at the largest logit (the row-parallel partial sums added in another order)."""
    source, _, spec = reshard_target(name)
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    if source == SOURCE:  # the frozen source's module: test_frozen_parameters_carry_over
        module, expected = union_of([r["module"] for r in target]), union_of([r["module"] for r in before])
        assert module.keys() == expected.keys() == {"running", "step_count"}
        same = [bits_equal(t, expected[n]) for n, t in module.items()]
        assert all(same) if name not in VIA_UNIVERSAL else not any(same), name
    logits, reference = logits_of(target), logits_of(before)
    assert logits.abs().max() > 0 and logits.shape == reference.shape
    if spec.get("tp", 1) == source_spec(source)["tp"]:
        assert bits_equal(logits, reference)
    else:
        bound = max(spec.get("tp", 1), 2) * torch.finfo(torch.bfloat16).eps * reference.abs().max().item()
        assert (logits - reference).abs().max().item() <= bound, (logits - reference).abs().max()


@pytest.mark.parametrize("name", [n for n in MOVES if DEGREE_RESHARDS[n][0] == FROZEN_SOURCE])
def test_frozen_parameters_carry_over(name, ds):
    """The target job's frozen parameters (filled with noise before loading), put together over its tensor ranks, are
    the ones the source's own stage-0 job holds after loading the source, bit for bit: in the module at ZeRO-1/2 (and
    ``frozen_param_fragments`` at ZeRO-2), each rank's share at ZeRO-3, cut for the split's degree, whole merged.
    Through the universal folder they are the job's own (``load_universal`` reads no module; the job is seeded as the
    source's was, so they are the same values)."""
    source, _, _ = reshard_target(name)
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    held, loaded = (merged(records, lambda r: r["module"], FROZEN) for records in (target, before))
    assert held.keys() == loaded.keys() == FROZEN.keys()
    for n, value in loaded.items():
        assert bits_equal(held[n], value), n


@pytest.mark.parametrize("name", sorted(set(MOVES) - VIA_UNIVERSAL))
def test_the_output_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a ZeRO checkpoint of the target stage and layout, the same whole model and optimizer
    state (a static loss scaler of scale 1 added: every ZeRO file pickles one)."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    tp = spec.get("tp", 1)
    assert before.kind == Kind.STAGE0 and after.kind == (Kind.MODEL_PARALLEL if tp > 1 else Kind.ZERO)
    assert len(after.domains) == tp
    for domain in after.domains:
        layout = domain.manifest.layout
        assert (layout.zero_stage, layout.world_size) == (spec["stage"], world_size // tp)
    check_same_to_ckptspec(before, after, unit_scaler_added=True)


# DeepSpeed's own saves of the same AutoTP MLP at a target layout (tp2 x dp2 ZeRO-2 and tp2 x dp1 ZeRO-3, bf16, without
# the buffers): the files a move to that layout writes are compared with them entry for entry
NATIVE = {"tp2-s0-bf16-ws2-buffers>s2-ws4": "tp2dp2-s2-bf16-ws4", "tp2-s0-bf16-ws2-buffers>s3": "tp2-s3-bf16-ws2"}
# merged, the frozen source is the dense MLP at ZeRO-2 (tp1 x dp2) with the same frozen parameters
NATIVE["tp2-s0-bf16-ws2-frozen>tp1-s2"] = "dense-s2-bf16-ws2-frozen"


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_the_files_have_the_shape_of_deepspeeds_own_save(name, ds):
    """The same files as DeepSpeed's own save at the target layout; in each, the same keys in the same order, every
    tensor's dtype and shape, the entries a ZeRO job saves where a stage-0 one saves None (``frozen_param_shapes`` and
    ``frozen_param_fragments``). What differs, by design: the buffers (the source has them, DeepSpeed's save of this
    model not), a torch state's key order, ``clip_grad``, which a stage-0 wrapper does not save (the target job's
    ``gradient_clipping`` applies, as DeepSpeed's loader does), and at ZeRO-3 the sub-group size the writer cut by,
    recorded in the saved ``ds_config`` (DeepSpeed's default, which the job uses)."""
    ours_dir = ds.path(name) / "resharded"
    native_dir = ds.path(NATIVE[name])
    tag = (native_dir / "latest").read_text().strip()
    files = sorted(p.name for p in (native_dir / tag).iterdir())
    assert sorted(p.name for p in (ours_dir / tag).iterdir() if p.name != "ckptspec.json") == files  # and its sidecar
    for file in files:
        ours, theirs = (
            torch.load(d / tag / file, map_location="cpu", weights_only=False) for d in (ours_dir, native_dir)
        )
        ours.pop(CLIENT_STATE_KEY, None)  # a data-parallel output's embedded manifest (the merge's)
        assert list(ours) == list(theirs), file
        if file.endswith("_model_states.pt"):
            buffers = set(ours["buffer_names"])
            ours["module"] = {n: t for n, t in ours["module"].items() if n not in buffers}
            ours["buffer_names"] = []
            zero = ours["ds_config"]["zero_optimization"]
            assert zero.pop("sub_group_size", int(1e9)) == int(1e9)
            assert shape_of(ours) == shape_of(theirs), file
            for key in ("frozen_param_shapes", "frozen_param_fragments"):  # the frozen values: never trained
                assert list(ours[key]) == list(theirs[key]), (file, key)
                for k, v in ours[key].items():
                    assert bits_equal(torch.as_tensor(v), torch.as_tensor(theirs[key][k])), (file, key, k)
            continue
        osd, native = ours["optimizer_state_dict"], theirs["optimizer_state_dict"]
        assert [k for k in native if k != "clip_grad"] == list(osd), file
        for key in osd:  # dicts compared whatever their order (a torch state's keys)
            assert shape_of(osd[key]) == shape_of(native[key]), (file, key)


def test_deepspeeds_own_converter_fails_on_the_same_source(ds):
    """Side by side: the saving job ran DeepSpeed's ``ds_to_universal`` on the same tag, which finds no
    ``*_optim_states.pt`` at stage 0."""
    outcome = info(ds.path(SOURCE))["universal"]
    assert outcome["ok"] is False and "can't find *_optim_states.pt files" in outcome["error"], outcome


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--world-size", "2", "--stage", "1", "--sub-group-size", "300"], "--sub-group-size 300 with --stage 1"),
        (["--world-size", "2", "--sub-group-size", "300"], "--sub-group-size 300 with --stage 0"),
        (["--world-size", "3", "--stage", "1"], "--world-size 3 is not a multiple of the target's tensor degree (2)"),
        (["--world-size", "3"], "--world-size 3 is not a multiple of the target's tensor degree (2)"),
        (["--world-size", "6", "--tensor-parallel", "4"], "--world-size 6 is not a multiple of the target's tensor"),
    ],
)
def test_what_is_not_written_is_refused_by_name(args, refusal, ds, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reshard", str(ds.path(SOURCE)), str(out), *args])
    assert result.exit_code == 1 and "CK410" in result.output and refusal in result.output, result.output
    assert "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())
