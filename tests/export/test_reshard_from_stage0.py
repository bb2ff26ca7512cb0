"""#40: a ZeRO stage-0 checkpoint written as a ZeRO-1/2/3 checkpoint (``reshard --stage 1|2|3`` of a stage-0
source): a data-parallel one (fp32, bf16; ZeRO-3 too: the ZeRO-3 writer) and a bf16 pipeline (DeepSpeed's
BF16_Optimizer) as a ZeRO-1 pipeline; and as
DeepSpeed's universal folder (``export-universal``; DeepSpeed's ``ds_to_universal`` refuses stage 0), loaded by a
ZeRO job with ``load_universal``.

Ground truth: a real DeepSpeed job of the same model at the target stage and world size resumes from what
``ckptspec reshard`` wrote (``engine.load_checkpoint``: tests/_harness/optim_job.py, ``DEGREE_RESHARDS``) and records
the fp32 masters (``safe_get_full_fp32_param``), Adam moments (``safe_get_full_optimizer_state``), step, param
groups, buffers and the logits of a fixed batch. The stage-0 source's own job (its ``+optim`` entry) recorded the
same after loading the source: every value must be equal, bit for bit (the same model at one data-parallel layout
or another computes the same forward pass, so the logits too).
"""

from __future__ import annotations

import json

import pytest
import torch
from _harness.parallel_oracles import (
    bits_equal,
    check_exported_optimizer_state,
    check_same_moments_and_step,
    check_same_to_ckptspec,
    info,
    logits_of,
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

# a stage-0 MoE's: test_reshard_moe_stage0.py; an AutoTP one's: test_reshard_from_autotp_stage0.py
FROM_STAGE0 = sorted(
    n
    for n, (source, *_) in DEGREE_RESHARDS.items()
    if source_spec(source)["stage"] == 0
    and not source_spec(source).get("ep")
    and source_spec(source).get("tp", 1) == 1
    and reshard_target(n)[2]["stage"] != 0
)  # a stage-0 pipeline kept at stage 0: test_reshard_pipeline_stage0.py; AutoTP: test_reshard_from_autotp_stage0.py
# those through ckptspec's universal folder (export-universal), loaded with DeepSpeed's load_universal
VIA_UNIVERSAL = {n for n in FROM_STAGE0 if DEGREE_RESHARDS[n][3].get("export_universal")}


@pytest.mark.parametrize("name", FROM_STAGE0)
def test_a_zero_job_resumes_the_stage0_checkpoint_bit_for_bit(name, ds):
    source, world_size, spec = reshard_target(name)
    entry = ds.path(name)
    outcome = json.loads((entry / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    target, before = optim_records(entry), optim_records(ds.path(optim_name(source)))
    assert len(target) == world_size and len(before) == 2
    assert {r["coords"].get("pp") for r in target} == {r["coords"].get("pp") for r in before}
    assert sorted({tuple(r["coords"].get("stage_layers") or ()) for r in target}) == sorted(
        {tuple(r["coords"].get("stage_layers") or ()) for r in before}
    )
    masters = union_of([r["master"] for r in target])
    # The masters the stage-0 job held when it saved (its oracle), and, where DeepSpeed's getter answers after
    # loading the source (BF16_Optimizer; not the other stage-0 optimizers), those too
    expected = union_of([oracle["masters"] for oracle in rank_oracles(ds.path(source))])
    assert masters.keys() == expected.keys() and masters
    loaded = union_of([r["master"] for r in before])
    bf16_optimizer = spec.get("pp", 1) > 1 and source_spec(source)["dtype"] == "bf16"  # a stage-0 bf16 pipeline's
    assert loaded.keys() in (set(), masters.keys()) and (loaded or not bf16_optimizer)
    for n, master in masters.items():
        assert bits_equal(master, expected[n]) and (not loaded or bits_equal(master, loaded[n])), n
    check_same_moments_and_step(target, before, masters)
    assert all(r["param_groups"] == before[0]["param_groups"] for r in target)


@pytest.mark.parametrize("name", FROM_STAGE0)
def test_buffers_and_logits_carry_over(name, ds):
    source, _, spec = reshard_target(name)
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    module, expected = union_of([r["module"] for r in target]), union_of([r["module"] for r in before])
    assert module.keys() == expected.keys()
    if spec.get("buffers"):
        assert module, "the spec has buffers: none recorded"
    for n, t in module.items():
        assert bits_equal(t, expected[n]), n
    logits = logits_of(target)
    assert logits.abs().max() > 0 and bits_equal(logits, logits_of(before))


@pytest.mark.parametrize("name", sorted(set(FROM_STAGE0) - VIA_UNIVERSAL))
def test_the_zero_checkpoint_is_the_source_to_ckptspec(name, ds):
    """Valid from its files, a ZeRO checkpoint of the target stage, the same whole model and optimizer state."""
    source, world_size, spec = reshard_target(name)
    out = ds.path(name) / "resharded"
    assert CliRunner().invoke(cli, ["validate", str(out)]).exit_code == 0
    before, after = ckptspec.open(ds.path(source)), ckptspec.open(out)
    pipeline = spec.get("pp", 1) > 1
    assert before.kind == (Kind.PIPELINE_STAGE0 if pipeline else Kind.STAGE0)
    assert after.kind == (Kind.MODEL_PARALLEL if pipeline else Kind.ZERO) and len(after.domains) == spec.get("pp", 1)
    for domain in after.domains:
        layout = domain.manifest.layout
        assert (layout.zero_stage, layout.world_size) == (spec["stage"], world_size // spec.get("pp", 1))
    check_same_to_ckptspec(before, after, unit_scaler_added=True)


@pytest.mark.parametrize(
    "source,stage,options,refusal",
    [
        ("s0-fp16-ws2", 2, {}, "dynamic loss scale: its FP16_UnfusedOptimizer does not save"),  # no hysteresis
        ("s0-fp16-ws2", 3, {}, "dynamic loss scale: its FP16_UnfusedOptimizer does not save"),
        ("s0-fp16-ws2-fused", 2, {}, "dynamic loss scale: its FP16_Optimizer does not save"),  # DeepSpeed's FusedAdam
        ("pp2-s0-bf16-ws2", 2, {}, "--stage 2 for a stage-0 pipeline"),  # DeepSpeed pipelines: ZeRO-1 at most
        ("pp2-s0-bf16-ws2", 3, {}, "--stage 3 for a stage-0 pipeline"),
        ("s0-bf16-ws2", 1, {"sub_group_size": 300}, "--sub-group-size 300 with --stage 1"),  # a ZeRO-3 target's
    ],
)
def test_what_is_not_written_is_refused_by_name(source, stage, options, refusal, ds, tmp_path):
    with pytest.raises(ckptspec.Unsupported) as refused:
        ckptspec.reshard(ds.path(source), tmp_path / "out", world_size=2, zero_stage=stage, **options)
    assert refused.value.code == "CK410" and refusal in refused.value.message, refused.value.message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# where the saving job ran ds_to_universal too (the fp32 stage-0 pipeline's did not)
@pytest.mark.parametrize(
    "name", sorted(n for n in VIA_UNIVERSAL if source_spec(DEGREE_RESHARDS[n][0]).get("universal"))
)
def test_deepspeeds_own_converter_fails_on_the_same_source(name, ds):
    """Side by side: the saving job ran DeepSpeed's ``ds_to_universal`` on the same tag, which fails there (no
    ``*_optim_states.pt`` at stage 0; ``param_shapes`` not dictionaries in the BF16_Optimizer pipeline)."""
    outcome = info(ds.path(DEGREE_RESHARDS[name][0]))["universal"]
    assert outcome["ok"] is False and outcome["error"], outcome


FROZEN = ["blocks.0.up.weight", "head.bias"]


def test_the_fp32_frozen_source_is_described_as_the_job_held_it(ds, ckptspec_cli, tmp_path):
    """fp32 at stage 0 keeps no masters apart from the module: the client torch Adam's ``state_dict()`` (the model
    states' ``optimizer``) lists the 8 parameters it steps of the module's 10, and their moments' shapes name them in
    module order (layout/stage0_names.client_moments, frozen_apart), the other two frozen. Valid from its files; read
    whole, the masters are the ones the job held when it saved (its oracle) and the frozen parameters its module's, bit
    for bit; the optimizer state exported is what DeepSpeed's job holds after loading the checkpoint (``+optim``)."""
    entry = ds.path("s0-fp32-ws2-frozen")
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    opened = ckptspec.open(entry)
    assert opened.kind == Kind.STAGE0 and [f.name for f in opened.domains[0].manifest.frozen] == FROZEN
    oracles = rank_oracles(entry)
    masters, module = union_of([o["masters"] for o in oracles]), union_of([o["module"] for o in oracles])
    read = opened.state_dict()
    assert read.keys() == module.keys() and masters.keys() == module.keys() - set(FROZEN) and len(masters) == 8
    for n, weight in module.items():
        assert bits_equal(read[n], masters.get(n, weight)), n
    out = tmp_path / "out"
    assert ckptspec_cli("reconstruct", entry, out, "--quiet", "--optimizer-state").output == ""
    records = optim_records(ds.path(optim_name("s0-fp32-ws2-frozen")))
    oracle = {k: {n: v for r in records for n, v in r[k].items()} for k in ("state", "step", "group")}
    check_exported_optimizer_state(out, {**oracle, "param_groups": records[0]["param_groups"]}, entry.name)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_frozen_parameters_are_written_as_deepspeeds_own_zero2_save_holds_them(dtype, ds, tmp_path):
    """The stage-0 source with frozen parameters (``s0-<dtype>-ws2-frozen``: blocks.0.up.weight and head.bias, named
    by the masters' shapes; fp32: by its torch Adam's moments' shapes) written as ZeRO-2 at its world size has the files
    of DeepSpeed's own ZeRO-2 save of the same model (``dense-s2-<dtype>-ws2-frozen``): the same names, in each the same
    keys in the same order, every tensor's dtype and shape, and the frozen parameters where a ZeRO-2 job keeps them: in
    the module, ``frozen_param_shapes`` and ``frozen_param_fragments`` (whole), bit for bit the saved ones (never
    trained: both jobs hold their seeded values). What differs by design: ``clip_grad``, which the stage-0 wrapper (the
    torch optimizer) does not save (the target job's ``gradient_clipping`` applies, as DeepSpeed's loader does), and
    the embedded manifest and sidecar."""
    out = tmp_path / "out"
    ckptspec.reshard(ds.path(f"s0-{dtype}-ws2-frozen"), out, world_size=2, zero_stage=2)
    native_dir = ds.path(f"dense-s2-{dtype}-ws2-frozen")
    tag = (native_dir / "latest").read_text().strip()
    files = sorted(p.name for p in (native_dir / tag).iterdir())
    assert sorted(p.name for p in (out / tag).iterdir() if p.name != "ckptspec.json") == files  # and its sidecar
    for file in files:
        ours, theirs = (torch.load(d / tag / file, map_location="cpu", weights_only=False) for d in (out, native_dir))
        ours.pop(CLIENT_STATE_KEY, None)
        assert list(ours) == list(theirs), file
        if file.endswith("_model_states.pt"):
            assert shape_of(ours) == shape_of(theirs), file
            assert list(ours["frozen_param_shapes"].items()) == list(theirs["frozen_param_shapes"].items())
            assert list(ours["frozen_param_fragments"]) == FROZEN
            for n, t in theirs["frozen_param_fragments"].items():
                assert bits_equal(ours["frozen_param_fragments"][n], t) and bits_equal(ours["module"][n], t), n
            continue
        osd, native = ours["optimizer_state_dict"], theirs["optimizer_state_dict"]
        assert [k for k in native if k != "clip_grad"] == list(osd), file
        for key in osd:
            assert shape_of(osd[key]) == shape_of(native[key]), (file, key)
