"""#40: a tensor x pipeline checkpoint at ZeRO stage 0 (scenarios.TP_PIPE_STAGE0_SPECS: the Megatron-style tp2 x pp2
PipelineModule of job/tp_layers.py trained at stage 0: bf16 with BF16_Optimizer, fp32 with the torch optimizer itself)
described, validated, reconstructed and written as ZeRO-1 (``reshard --stage 1``: each (stage, tensor rank) domain on
its own, reshard_stage0_source); and the ZeRO-1 tp x pp checkpoints (TP_PIPE_SPECS) written for a stage-0 job of the
same degrees (``reshard --stage 0``, reshard_pipeline_stage0), compared with DeepSpeed's own stage-0 saves.

Ground truth: DeepSpeed 0.19.8 saves these jobs on the CPU and resumes them at their own layout (their ``+optim``
entries: bf16 with the ``load_optimizer_states=False`` + ``_load_zero_checkpoint`` load, as every bf16 stage-0
pipeline); a real tp2 x pp2 ZeRO-1 job loads ckptspec's output (scenarios.TP_PIPE_STAGE0_RESHARDS, optim_job.py) and
holds, rank by rank, the masters the saving job held (its oracle), the moments, step and param groups its own resume
holds, the same logits, and after one more training step the same state as that resume after the same step. The
whole tensors are put together by the job's own split rules (job/tp_layers.py), never by ckptspec's reading of the
saved patterns. The stage-0 targets are loaded by real tp2 x pp2 stage-0 jobs the same way and compared with the
ZeRO-1 source's job and resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness.faults import tag_dir
from _harness.parallel_oracles import (
    assert_same,
    bits_equal,
    gathered_whole,
    info,
    optim_records,
    rank_oracles,
    saved_entries,
)
from _harness.reconstruction import invoke
from _harness.scenarios import TP_PIPE_STAGE0, TP_PIPE_STAGE0_RESHARDS, optim_name, reshard_target
from safetensors.torch import load_file

import ckptspec
from ckptspec.deepspeed.kinds import Kind

TO_ZERO1 = sorted(n for n in TP_PIPE_STAGE0_RESHARDS if reshard_target(n)[2]["stage"] == 1)
TO_STAGE0 = sorted(n for n in TP_PIPE_STAGE0_RESHARDS if reshard_target(n)[2]["stage"] == 0)
TP = 2
SPLIT = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # the blocks' (layers 2 and 3); every other tensor whole
MOMENTS = ("exp_avg", "exp_avg_sq")


def _split_dim(name: str) -> int | None:
    layer, attr = name.split(".", 1)
    return SPLIT.get(attr) if layer in ("2", "3") else None


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _whole_moments(records: list[dict]) -> dict:
    """moment -> name -> the whole tensor of a tp x pp job's per-rank records: shards concatenated in tensor-rank order
    along the job's split dim, a replicated one as held (every tensor rank's the same: asserted)."""
    out: dict = {key: {} for key in MOMENTS}
    for key in MOMENTS:
        by_tensor = sorted(records, key=lambda r: r["coords"]["tp"])
        for name in {n for r in records for n in r["state"]}:
            shards = [r["state"][name][key] for r in by_tensor if name in r["state"]]
            assert len(shards) == TP, name
            dim = _split_dim(name)
            if dim is None:
                assert bits_equal(shards[0], shards[1]), (name, key)
                out[key][name] = shards[0]
            else:
                out[key][name] = torch.cat(shards, dim=dim)
    return out


@pytest.mark.parametrize("name", TP_PIPE_STAGE0)
def test_deepspeed_saves_the_stage0_tp_pipeline_and_resumes_it(ds, name):
    """The saving job's optimizer and files, and its resume at its own layout: load_checkpoint fails on the bf16
    one's optimizer state (KeyError: 0, as on every bf16 stage-0 pipeline save) and loads the fp32 one;
    ds_to_universal fails on both."""
    meta = info(ds.path(name))
    bf16 = meta["spec"]["dtype"] == "bf16"
    assert meta["optimizer_class"] == ("BF16_Optimizer" if bf16 else "Adam")
    names = sorted(p.name for p in tag_dir(ds.path(name)).iterdir())
    layers = [f"layer_{layer:02d}-model_{tp:02d}-model_states.pt" for layer in range(5) for tp in range(TP)]
    optim = [f"bf16_zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt" for mp in range(4)] if bf16 else []
    assert names == sorted([*layers, *optim, *(f"mp_rank_{mp:02d}_model_states.pt" for mp in range(4))])
    # DeepSpeed's own path to another layout fails on both (the saving job ran ds_to_universal on its tag)
    failed = meta["universal"]["error"]
    if bf16:
        assert failed.startswith("RuntimeError: DeepSpeed checkpoint param_shapes must contain dictionaries"), failed
    else:
        assert failed.startswith("FileNotFoundError: can't find *_optim_states.pt files"), failed
    resumed = json.loads((ds.path(optim_name(name)) / "optim.json").read_text())
    assert resumed["load_checkpoint_error"] == ("KeyError: 0" if bf16 else None), resumed
    records, oracles = optim_records(ds.path(optim_name(name))), rank_oracles(ds.path(name))
    for record, oracle in zip(records, oracles):
        assert record["coords"] == oracle["coords"]
        assert set(record["step"].values()) == {2.0}
        if bf16:  # BF16_Optimizer's getters: the resumed masters are the saved job's
            assert record["master"].keys() == oracle["masters"].keys()
            assert all(bits_equal(record["master"][n], m) for n, m in oracle["masters"].items())


@pytest.mark.parametrize("name", TP_PIPE_STAGE0)
def test_the_index_places_each_tensor_ranks_shard_by_the_saved_rules(ds, name, tmp_path):
    result = invoke("validate", ds.path(name))
    assert result.exit_code == 0 and result.stdout.strip().endswith("valid"), result.stdout
    result = invoke("inspect", ds.path(name))
    assert "pipeline 2 x tensor 2 x data 1 (checkpoint_parallel_dimensions)" in result.stdout
    assert "12 parameters (2501 elements; 6 replicated, 6 split), 10 layer files" in result.stdout
    opened = ckptspec.open(ds.path(name))
    stored = "module" if info(ds.path(name))["spec"]["dtype"] == "fp32" else "optimizer_states"
    assert opened.kind == Kind.PIPELINE_STAGE0 and {d.masters.stored_in for d in opened.domains} == {stored}
    assert invoke("generate", ds.path(name), "-o", tmp_path / "index.json").exit_code == 0
    doc = json.loads((tmp_path / "index.json").read_text())
    assert doc["topology"]["degrees"] == {"pipeline": 2, "tensor": 2, "data": 1}
    shapes = info(ds.path(name))["global_shapes"]
    for param in doc["parameters"]:
        assert param["placement_source"] == "universal_checkpoint_info" and param["shape"] == shapes[param["name"]]
        dim, layer = _split_dim(param["name"]), int(param["name"].split(".")[0])
        for tp, shard in enumerate(param["shards"]):
            assert shard["domain"] == f"pp{0 if layer < 3 else 1}-tp{tp}"
            assert shard["layer_file"] == f"layer_{layer:02d}-model_{tp:02d}-model_states.pt"
            if dim is None:
                assert shard["placement"] == "replicated" and shard["primary"] == (tp == 0)
            else:
                length = shapes[param["name"]][dim] // TP
                assert shard["placement"] == {"split": {"axis": dim, "offset": tp * length, "length": length}}
    assert invoke("validate", tmp_path / "index.json", "--checkpoint", ds.path(name)).exit_code == 0


@pytest.mark.parametrize("name", TP_PIPE_STAGE0)
def test_reconstruct_gives_the_live_masters_and_the_resumed_moments_bit_for_bit(ds, name, tmp_path):
    """The whole masters the saving job gathered over its tensor groups, and the moments its resume holds (put
    together by the job's split rules); the bf16 job's own gathered moments too (the fp32 torch optimizer has no
    getter)."""
    result = invoke("reconstruct", ds.path(name), tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 0, result.output
    whole = gathered_whole(ds.path(name))
    model = load_file(tmp_path / "out" / "model.safetensors")
    optimizer = load_file(tmp_path / "out" / "optimizer.safetensors")
    assert sorted(model) == sorted(whole["master"]) == sorted(info(ds.path(name))["global_shapes"])
    for key, master in whole["master"].items():
        assert bits_equal(model[key], master), key
    resumed = _whole_moments(optim_records(ds.path(optim_name(name))))
    for moment in MOMENTS:
        assert sorted(resumed[moment]) == sorted(whole["master"])
        for key, value in resumed[moment].items():
            assert bits_equal(optimizer[f"{key}.{moment}"], value), (key, moment)
        if info(ds.path(name))["spec"]["dtype"] == "bf16":
            assert all(bits_equal(optimizer[f"{k}.{moment}"], v) for k, v in whole[moment].items())


@pytest.mark.parametrize("name", TO_ZERO1)
def test_a_zero1_tp_pipeline_job_resumes_the_output_bit_for_bit(ds, name):
    """Rank by rank (the same tensor and pipeline coordinates): the saving job's masters, its resume's moments, step
    and param groups, through DeepSpeed's ZeRO-1 getters; the same logits; one more step gives what the stage-0
    resume gives after it (masters and moments bit for bit: one data rank, the same sums)."""
    source, world_size, spec = reshard_target(name)
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert outcome.get("reshard_error") is None and outcome["load_checkpoint_error"] is None, outcome
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    oracles = rank_oracles(ds.path(source))
    assert len(target) == world_size == 4 and spec["stage"] == 1
    for mine, theirs, oracle in zip(target, before, oracles):
        assert mine["coords"] == theirs["coords"] == oracle["coords"]
        assert set(mine["source"].values()) == {"safe_get_full_optimizer_state"} and all(mine["getter"].values())
        assert mine["master"].keys() == oracle["masters"].keys() == theirs["state"].keys()
        for local, master in oracle["masters"].items():
            assert bits_equal(mine["master"][local], master), (mine["coords"], local)
            for key in MOMENTS:
                assert bits_equal(mine["state"][local][key], theirs["state"][local][key]), (local, key)
        assert mine["step"] == theirs["step"] and set(mine["step"].values()) == {2.0}
        assert mine["param_groups"] == theirs["param_groups"]
        if theirs["logits"] is not None:
            assert mine["logits"].abs().max() > 0 and bits_equal(mine["logits"], theirs["logits"])
    stepped, stepped_before = optim_records(ds.path(name), "step"), optim_records(ds.path(optim_name(source)), "step")
    for mine, theirs in zip(stepped, stepped_before):
        assert set(mine["step"].values()) == set(theirs["step"].values()) == {3.0}
        for local, by_key in theirs["state"].items():
            for key in MOMENTS:
                assert bits_equal(mine["state"][local][key], by_key[key]), (mine["coords"], local, key)
        if theirs["master"]:  # the bf16 resume's BF16_Optimizer getters
            assert all(bits_equal(mine["master"][n], m) for n, m in theirs["master"].items())


@pytest.mark.parametrize("name", TO_ZERO1)
def test_the_files_are_deepspeeds_own_zero1_tp_pipeline_save(ds, name):
    """The file names, every key, tensor dtype and shape and every other value of DeepSpeed's own ZeRO-1 save of the
    same model (TP_PIPE_SPECS); an fp32 stage-0 source saved no ``clip_grad`` (the torch optimizer's state alone),
    so none is written and the target job's gradient_clipping applies, as DeepSpeed's loader does."""
    source, _, spec = reshard_target(name)
    ours = tag_dir(ds.path(name) / "resharded")
    theirs = tag_dir(ds.path(f"tp2pp2-s1-{spec['dtype']}-ws4"))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    absent = {"/optimizer_state_dict/clip_grad"} if spec["dtype"] == "fp32" else set()
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        expected = [k for k in native if not (file.endswith("optim_states.pt") and k in absent)]
        assert list(mine) == expected, file
        assert {k: v for k, v in mine.items() if v != native[k]} == {}, file


def test_the_cases_cover_both_ways_in_both_dtypes():
    assert sorted(reshard_target(n)[0] for n in TO_ZERO1) == TP_PIPE_STAGE0
    assert sorted(reshard_target(n)[0] for n in TO_STAGE0) == ["tp2pp2-s1-bf16-ws4", "tp2pp2-s1-fp32-ws4"]


@pytest.mark.parametrize("name", TO_STAGE0)
def test_a_stage0_tp_pipeline_job_resumes_the_output_bit_for_bit(ds, name):
    """A ZeRO-1 tp x pp checkpoint written for a stage-0 job of the same degrees: rank by rank, the masters (bf16:
    BF16_Optimizer's getter; fp32: the layer files' weights the job trains, as written) the ZeRO-1 job held, the
    moments, step and param groups its resume holds, the same logits, and after one more step what that resume holds
    after it (moments, logits, and the bf16 masters).
    The bf16 job loads it as DeepSpeed's own stage-0 save: load_checkpoint fails the same way (KeyError: 0); DeepSpeed's
    own path, ds_to_universal of the source with load_universal, fails in the same stage-0 job."""
    source, world_size, spec = reshard_target(name)
    bf16 = spec["dtype"] == "bf16"
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    native = json.loads((ds.path(optim_name(f"tp2pp2-s0-{spec['dtype']}-ws4")) / "optim.json").read_text())
    assert outcome.get("reshard_error") is None, outcome
    assert outcome["load_checkpoint_error"] == native["load_checkpoint_error"] == ("KeyError: 0" if bf16 else None)
    failed = outcome["universal_error"]
    assert failed == (
        "TypeError: 'NoneType' object is not subscriptable"
        if bf16
        else "AttributeError: 'NoneType' object has no attribute 'copy'"
    ), failed
    target, before = optim_records(ds.path(name)), optim_records(ds.path(optim_name(source)))
    oracles, tag = rank_oracles(ds.path(source)), tag_dir(ds.path(name) / "resharded")
    assert len(target) == world_size == 4 and spec["stage"] == 0
    for mine, theirs, oracle in zip(target, before, oracles):
        assert mine["coords"] == theirs["coords"] == oracle["coords"]
        assert all(mine["getter"].values()) == bf16  # DeepSpeed's getters answer for BF16_Optimizer only
        assert mine["state"].keys() == oracle["masters"].keys() == theirs["state"].keys()
        tp = mine["coords"]["tp"]
        for local, master in oracle["masters"].items():
            if bf16:
                assert bits_equal(mine["master"][local], master), (mine["coords"], local)
            else:
                layer, key = local.split(".", 1)
                saved = torch.load(tag / f"layer_{int(layer):02d}-model_{tp:02d}-model_states.pt", weights_only=True)
                assert bits_equal(saved[key], master), (mine["coords"], local)
            for key in MOMENTS:
                assert bits_equal(mine["state"][local][key], theirs["state"][local][key]), (local, key)
        assert mine["step"] == theirs["step"] and set(mine["step"].values()) == {2.0}
        assert mine["param_groups"] == theirs["param_groups"]
        if theirs["logits"] is not None:
            assert mine["logits"].abs().max() > 0 and bits_equal(mine["logits"], theirs["logits"])
    stepped, stepped_before = optim_records(ds.path(name), "step"), optim_records(ds.path(optim_name(source)), "step")
    for mine, theirs in zip(stepped, stepped_before):
        assert set(mine["step"].values()) == set(theirs["step"].values()) == {3.0}
        for local, by_key in theirs["state"].items():
            for key in MOMENTS:
                assert bits_equal(mine["state"][local][key], by_key[key]), (mine["coords"], local, key)
        if bf16:  # the fp32 stage-0 job has no getter: its stepped weights show in the logits below
            assert mine["master"].keys() == theirs["master"].keys()
            assert all(bits_equal(mine["master"][n], m) for n, m in theirs["master"].items())
        if theirs["logits"] is not None:  # the fixed batch through the stepped weights
            assert bits_equal(mine["logits"], theirs["logits"])


@pytest.mark.parametrize("name", TO_STAGE0)
def test_the_files_are_deepspeeds_own_stage0_tp_pipeline_save(ds, name):
    """The file names, every key, tensor dtype and shape and every other value (the layout entries, degrees, the
    saved stage, the split rules) of DeepSpeed's own stage-0 save of the same model at the same layout."""
    _, _, spec = reshard_target(name)
    ours, theirs = tag_dir(ds.path(name) / "resharded"), tag_dir(ds.path(f"tp2pp2-s0-{spec['dtype']}-ws4"))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    assert sum("optim_states" in f for f in files) == (4 if spec["dtype"] == "bf16" else 0)
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert list(mine) == list(native), file
        assert {k: v for k, v in mine.items() if v != native[k]} == {}, file


@pytest.mark.parametrize("name", TP_PIPE_STAGE0)
def test_the_same_layout_is_deepspeeds_save_value_for_value(ds, name, tmp_path):
    """DeepSpeed's stage-0 tp x pp save written anew at its own layout: every file, key and value (tensors bit for
    bit); the command names the load that resumes a bf16 one (load_checkpoint alone fails, KeyError: 0)."""
    result = invoke("reshard", ds.path(name), tmp_path / "out", "--world-size", "4", "--stage", "0")
    assert result.exit_code == 0, result.output
    bf16 = info(ds.path(name))["spec"]["dtype"] == "bf16"
    assert ("load_optimizer_states=False), then engine._load_zero_checkpoint(" in result.output) == bf16
    ours, theirs = tag_dir(tmp_path / "out"), tag_dir(ds.path(name))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files
    for file in files:
        assert_same(_load(ours / file), _load(theirs / file), file)


@pytest.mark.parametrize(
    ("source", "options", "refusal"),
    [
        ("tp2pp2-s1-fp32-ws4", {"zero_stage": 0, "world_size": 6}, "not a multiple of the pipeline x tensor degrees"),
    ],
)
def test_what_is_not_written_at_stage0_is_refused_by_name(ds, tmp_path, source, options, refusal):
    from ckptspec.export.reshard_parallel import reshard_model_parallel

    world_size = options.pop("world_size", 4)
    with pytest.raises(ckptspec.Unsupported) as refused:
        reshard_model_parallel(ds.path(source), tmp_path / "out", world_size, **options)
    assert refused.value.code == "CK410" and refusal in refused.value.message, refused.value.message
    assert refused.value.file == str(ds.path(source))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"zero_stage": 2}, "ZeRO stage 1 and stage-0 targets are written"),
        ({"zero_stage": 1, "world_size": 6}, "--world-size 6 is not a multiple of the pipeline x tensor degrees (4)"),
    ],
)
def test_what_is_not_written_is_refused_by_name(ds, tmp_path, options, refusal):
    from ckptspec.export.reshard_parallel import reshard_model_parallel

    source = ds.path(TP_PIPE_STAGE0[0])
    world_size = options.pop("world_size", 4)
    with pytest.raises(ckptspec.Unsupported) as refused:
        reshard_model_parallel(source, tmp_path / "out", world_size, **options)
    assert refused.value.code == "CK410" and refusal in refused.value.message, refused.value.message
    assert refused.value.file == str(source)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
