"""Issue #40: a tensor x pipeline-parallel checkpoint (tp2 x pp2, Megatron-style layers: scenarios.TP_PIPE_SPECS)
moved to one stage, keeping its tensor degree (``reshard --pipeline-parallel 1``: tp2 x pp1) or merged too
(``--tensor-parallel 1 --pipeline-parallel 1``: tp1 x pp1), and DeepSpeed's tp2 x pp1 save moved to two stages
(tp2 x pp2), each loaded by a real job of the target layout (scenarios.TP_PIPE_STAGE_RESHARDS,
tests/_harness/optim_job.py).

Ground truth: what the source job recorded from the live engine (each rank's own masters, and the masters, Adam
moments and module gathered whole over its tensor groups: job/tp_layers.py) and its logits; the tp2 x pp1 files
against what DeepSpeed itself saves at that layout (scenarios.TP_PIPE_ONE_SPECS; tp2 x pp2: TP_PIPE_SPECS). The
same target job also loaded DeepSpeed's path, ``ds_to_universal`` of a tp2 x pp2 source with ``load_universal``
(``universal.rank<R>.pt``).
"""

import json

import numpy as np
import pytest
import torch
from _harness import scenarios
from _harness.parallel_oracles import bits_equal, info, logits_of, optim_records, rank_oracles, structure
from _harness.reconstruction import invoke

CASES = sorted(scenarios.TP_PIPE_STAGE_RESHARDS)
KEPT = [n for n in CASES if "tensor_parallel" not in scenarios.TP_PIPE_STAGE_RESHARDS[n][3]]  # tp2 kept
UNIVERSAL = [n for n in CASES if scenarios.REGISTRY[n].args["universal"]]  # the source has a ds_to_universal folder
SAVED = {1: "tp2pp1-s1-fp32-ws2", 2: "tp2pp2-s1-fp32-ws4"}  # DeepSpeed's own fp32 saves at tp2, by stages
REFUSED = "tp2pp2-s1-bf16-ws4"  # the source of the refusals below
STAGE_LAYERS = {1: [[0, 5]], 2: [[0, 3], [3, 5]]}  # partition "uniform" of the five layers, by stages
# the merged blocks compute each output in one matmul where the source summed two tensor ranks' partials
# (test_reshard_tp_pipe.py); at the tensor degree kept, the same sums
LOGITS_SHARE = {"fp32": 1e-6, "bf16": 0.01}


def _source(name):
    return scenarios.TP_PIPE_STAGE_RESHARDS[name][0]


def info_spec(name):
    return scenarios.source_spec(_source(name))


def _tensor_degree(name):
    return scenarios.reshard_target(name)[2]["tp"]


def _stages(name):
    return scenarios.reshard_target(name)[2]["pp"]


def _expected(ds, source, tp):
    """(tensor rank, name) -> the master and Adam moments a target rank at tensor degree ``tp`` must hold: the source
    rank's own master (tp 2) or the whole one its tensor group gathered (tp 1); the moments cut from the whole ones
    where the master is a shard (along the axis whose size differs)."""
    out: dict = {}
    for oracle in rank_oracles(ds.path(source)):
        tensor = oracle["coords"]["tp"] if tp > 1 else 0
        masters = oracle["masters"] if tp > 1 else oracle["whole_masters"]
        for name, master in masters.items():
            whole = oracle["whole_moments"]
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                value = whole[key][name]
                axes = [i for i, (a, b) in enumerate(zip(master.shape, value.shape, strict=True)) if a != b]
                if axes:
                    value = value.chunk(tp, dim=axes[0])[tensor]
                moments[key] = value
            entry = {"master": master, **moments}
            known = out.setdefault((tensor, name), entry)
            assert all(bits_equal(known[k], v) for k, v in entry.items()), name  # every holder the same
    return out


def _check_loaded(records, expected, tp):
    held = set()
    for r in records:
        tensor = r["coords"]["tp"]
        for name, master in r["master"].items():
            held.add((tensor, name))
            assert bits_equal(master, expected[tensor, name]["master"]), (tensor, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(r["state"][name][key], expected[tensor, name][key]), (tensor, name, key)
            assert r["step"][name] == 2.0, (name, r["step"][name])  # the source trained two steps
            assert r["source"][name] == "safe_get_full_optimizer_state"
    assert sorted(held) == sorted(expected)


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_the_sources_masters_moments_and_step(ds, name):
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert "reshard_error" not in outcome and outcome["load_checkpoint_error"] is None, outcome
    records = optim_records(ds.path(name))
    tp, pp = _tensor_degree(name), _stages(name)
    per_stage = len(records) // pp  # the grid's ranks: pipeline-major, then data, then tensor
    assert [(r["coords"]["pp"], r["coords"]["tp"], r["coords"]["stage_layers"]) for r in records] == [
        (rank // per_stage, rank % tp, STAGE_LAYERS[pp][rank // per_stage]) for rank in range(len(records))
    ]
    _check_loaded(records, _expected(ds, _source(name), tp), tp)
    dtype = info(ds.path(_source(name)))["spec"]["dtype"]
    source_logits = logits_of(rank_oracles(ds.path(_source(name)))).float().numpy()
    off = np.abs(logits_of(records).float().numpy() - source_logits).max()
    assert off <= LOGITS_SHARE[dtype] * np.abs(source_logits).max(), off


@pytest.mark.parametrize("name", UNIVERSAL)
def test_deepspeeds_universal_path_gives_the_same(ds, name):
    assert json.loads((ds.path(name) / "optim.json").read_text())["universal_error"] is None
    tp = _tensor_degree(name)
    _check_loaded(optim_records(ds.path(name), "universal"), _expected(ds, _source(name), tp), tp)


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("name", [n for n in KEPT if info_spec(n)["dtype"] == "fp32"])
def test_the_files_are_deepspeeds_at_the_target_layout(ds, name):
    """The written tag against DeepSpeed's own save of the same PipelineModule at the target's tp2 x pp (fp32, the
    same world size): the same file names; the layer files' and optimizer files' keys and tensor shapes, the model
    states' layout entries the same."""
    saved = SAVED[_stages(name)]
    assert scenarios.SOURCE_SPECS[saved][1] == scenarios.TP_PIPE_STAGE_RESHARDS[name][1]
    ours = ds.path(name) / "resharded" / "global_step2"
    theirs = ds.path(saved) / info(ds.path(saved))["tag"]
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for file in names:
        a, b = _load(theirs / file), _load(ours / file)
        if "model_states" in file and not file.startswith("layer_"):
            for key in ("mp_world_size", "dp_world_size", "checkpoint_parallel_dimensions", "buffer_names", "module"):
                assert a.get(key) == b.get(key), (file, key)
            assert [dict(s) for s in a["param_shapes"]] == [dict(s) for s in b["param_shapes"]], file
        elif file.startswith("layer_"):
            assert structure(a) == structure(b), file
        else:
            assert structure(a["optimizer_state_dict"]) == structure(b["optimizer_state_dict"]), file


@pytest.mark.parametrize("name", CASES)
def test_the_layer_files_are_the_sources_or_merged_and_the_model_states_name_the_degrees(ds, name):
    """At tp2 each layer_LL-model_TT file is the source's, byte for byte (their names do not depend on the stage); at
    tp1 each layer_LL file holds the module the source gathered whole, bit for bit. The model states name the
    target's degrees."""
    tag = ds.path(name) / "resharded" / "global_step2"
    source = ds.path(_source(name)) / info(ds.path(_source(name)))["tag"]
    tp, pp = _tensor_degree(name), _stages(name)
    world_size = scenarios.TP_PIPE_STAGE_RESHARDS[name][1]
    whole = {}
    for oracle in rank_oracles(ds.path(_source(name))):
        whole.update(oracle["whole_module"])
    for layer in range(5):
        if tp > 1:
            for tensor in range(tp):
                file = f"layer_{layer:02d}-model_{tensor:02d}-model_states.pt"
                assert (tag / file).read_bytes() == (source / file).read_bytes(), file
            continue
        saved = torch.load(tag / f"layer_{layer:02d}-model_states.pt", weights_only=True)
        assert sorted(saved) == sorted(k.split(".", 1)[1] for k in whole if k.split(".")[0] == str(layer))
        for key, value in saved.items():
            assert bits_equal(value, whole[f"{layer}.{key}"]), (layer, key)
    for mp in range(tp * pp):
        states = _load(tag / f"mp_rank_{mp:02d}_model_states.pt")
        assert states["mp_world_size"] == tp * pp and states["dp_world_size"] == world_size // (tp * pp)
        assert states["checkpoint_parallel_dimensions"] == {"pp_degree": pp, "tp_degree": tp}
        assert states["module"] is None and "universal_checkpoint_info" in states  # the client state, as saved


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--world-size", "3", "--pipeline-parallel", "1"],
            "--world-size 3 is not a multiple of --pipeline-parallel 1 x the tensor degree 2",
        ),
        (
            ["--world-size", "2", "--pipeline-parallel", "1", "--stage", "2"],
            "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
        ),
        (["--world-size", "12", "--pipeline-parallel", "6"], "the pipeline has 5 layers, fewer than the stages"),
        (
            ["--world-size", "6", "--pipeline-parallel", "6", "--tensor-parallel", "1"],
            "the pipeline has 5 layers, fewer than the stages",
        ),
        (
            ["--world-size", "4", "--pipeline-parallel", "3", "--tensor-parallel", "1"],
            "--world-size 4 is not a multiple of --pipeline-parallel 3",
        ),
        (
            ["--world-size", "2", "--pipeline-parallel", "1", "--tensor-parallel", "1", "--stage", "2"],
            "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
        ),
    ],
)
def test_what_is_not_written_is_refused_by_name_before_writing(ds, tmp_path, options, message):
    result = invoke("reshard", ds.path(REFUSED), tmp_path / "out", *options)
    assert result.exit_code != 0 and "CK410" in result.output and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_partition_method_deepspeed_has_not_is_refused_before_the_merge_is_written(ds, tmp_path):
    """Through the Python API (the command line offers the two methods only): refused before the merge, whose
    temporary directory would otherwise be written first."""
    from ckptspec.errors import ReshardUnsupported
    from ckptspec.export.api import reshard

    source = ds.path(REFUSED)
    with pytest.raises(ReshardUnsupported, match="--partition-method 'type:Linear' is not supported"):
        reshard(source, tmp_path / "out", 2, tensor_parallel=1, pipeline_parallel=1, partition_method="type:Linear")
    assert not (tmp_path / "out").exists()
