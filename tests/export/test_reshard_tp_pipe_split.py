"""Issue #40: a tensor x pipeline-parallel checkpoint (Megatron-style layers: scenarios.TP_PIPE_SPECS,
TP_PIPE_ONE_SPECS) split to more tensor ranks (``reshard --tensor-parallel 4``: tp2 x pp1 -> tp4 x pp1; with
``--pipeline-parallel 1`` too: tp2 x pp2 -> tp4 x pp1), each loaded by a real tp4 x pp1 job (scenarios.TP_PIPE_SPLITS,
tests/_harness/optim_job.py).

Ground truth: what the source job gathered whole over its tensor groups from the live engine (masters, Adam moments,
module weights: job/tp_layers.py), cut into four where the target job's own parameter is a quarter of the whole one
(its Megatron layers: column-parallel rows, row-parallel columns); the step and the logits. The files against
DeepSpeed's own save of the same PipelineModule at tp4 x pp1 (scenarios.TP_PIPE_FOUR_SPECS).
"""

import json

import numpy as np
import pytest
import torch
from _harness import scenarios
from _harness.parallel_oracles import (
    assert_pieces_of_whole,
    bits_equal,
    gathered_whole,
    info,
    logits_of,
    optim_records,
    rank_oracles,
    structure,
    tensor_piece,
)
from _harness.reconstruction import invoke

CASES = sorted(scenarios.TP_PIPE_SPLITS)
SAVED = {4: "tp4pp1-s1-fp32-ws4", 2: "tp2pp1-s1-fp32-ws2"}  # DeepSpeed's own saves at the target layouts, by tp
REFUSED = "tp2pp2-s1-bf16-ws4"  # the source of the refusals below
# the logits of the fixed batch, as a share of the largest: the row-parallel blocks add four partial sums where the
# source added two (another rounding order only)
LOGITS_SHARE = {"fp32": 1e-6, "bf16": 0.01}


def _source(name):
    return scenarios.TP_PIPE_SPLITS[name][0]


def _whole(ds, source):
    return gathered_whole(ds.path(source))


def _tp(name):
    return scenarios.reshard_target(name)[2]["tp"]


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_the_sources_masters_moments_and_step(ds, name):
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert "reshard_error" not in outcome and outcome["load_checkpoint_error"] is None, outcome
    records = optim_records(ds.path(name))
    assert [(r["coords"]["pp"], r["coords"]["tp"]) for r in records] == [(0, t) for t in range(_tp(name))]
    whole = _whole(ds, _source(name))
    assert_pieces_of_whole(records, whole, _tp(name))
    split = [n for n, m in records[0]["master"].items() if m.shape != whole["master"][n].shape]
    assert sorted(split) == ["2.down.weight", "2.up.bias", "2.up.weight", "3.down.weight", "3.up.bias", "3.up.weight"]
    dtype = info(ds.path(_source(name)))["spec"]["dtype"]
    source_logits = logits_of(rank_oracles(ds.path(_source(name)))).float().numpy()
    off = np.abs(logits_of(records).float().numpy() - source_logits).max()
    assert off <= LOGITS_SHARE[dtype] * np.abs(source_logits).max(), off


@pytest.mark.parametrize("name", [n for n in CASES if scenarios.REGISTRY[n].args["universal"]])
def test_deepspeeds_universal_path_gives_the_same(ds, name):
    """The same tp4 job loading DeepSpeed's own ``ds_to_universal`` folder of the tp2 x pp2 source
    (``load_universal``) holds the same bits."""
    assert json.loads((ds.path(name) / "optim.json").read_text())["universal_error"] is None
    assert_pieces_of_whole(optim_records(ds.path(name), "universal"), _whole(ds, _source(name)), _tp(name))


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("name", CASES)
def test_the_files_are_deepspeeds_at_the_target_layout(ds, name):
    """The written tag against DeepSpeed's own save of the same PipelineModule at tp4 x pp1 (4 ranks, fp32): the same
    file names; the layer and optimizer files' keys and tensor shapes (and dtypes, from the fp32 sources); the model
    states' keys, layout entries and ``param_shapes``."""
    saved = SAVED[_tp(name)]
    assert scenarios.SOURCE_SPECS[saved][1] == scenarios.TP_PIPE_SPLITS[name][1]
    dtypes = info(ds.path(_source(name)))["spec"]["dtype"] == "fp32"
    ours = ds.path(name) / "resharded" / "global_step2"
    theirs = ds.path(saved) / info(ds.path(saved))["tag"]
    names = sorted(p.name for p in theirs.iterdir())
    # a bf16 job's optimizer files are named bf16_zero_pp_rank_...
    ours_of = {n: n if dtypes or not n.startswith("zero_pp_rank_") else f"bf16_{n}" for n in names}
    assert sorted(p.name for p in ours.iterdir()) == sorted(ours_of.values())
    for file in names:
        a, b = _load(theirs / file), _load(ours / ours_of[file])
        if "model_states" in file and not file.startswith("layer_"):
            assert sorted(a) == sorted(b), file
            for key in ("mp_world_size", "dp_world_size", "checkpoint_parallel_dimensions", "buffer_names", "module"):
                assert a.get(key) == b.get(key), (file, key)
            assert [dict(s) for s in a["param_shapes"]] == [dict(s) for s in b["param_shapes"]], file
        elif file.startswith("layer_"):
            assert structure(a, dtypes) == structure(b, dtypes), file
        else:
            assert structure(a["optimizer_state_dict"], dtypes) == structure(b["optimizer_state_dict"], dtypes), file


@pytest.mark.parametrize("name", CASES)
def test_the_layer_files_are_the_gathered_module_cut_and_the_model_states_name_the_degrees(ds, name):
    """Each layer_LL-model_TT file holds tensor rank TT's piece of the module the source gathered whole, bit for bit
    (its keys the saved file's); the model states name tp4 x pp1 and carry the saved split rules."""
    tag = ds.path(name) / "resharded" / "global_step2"
    whole = _whole(ds, _source(name))["module"]
    tp = _tp(name)
    saved = ds.path(SAVED[tp]) / info(ds.path(SAVED[tp]))["tag"]
    for layer in range(5):
        for tensor in range(tp):
            file = f"layer_{layer:02d}-model_{tensor:02d}-model_states.pt"
            ours, theirs = torch.load(tag / file, weights_only=True), torch.load(saved / file, weights_only=True)
            assert list(ours) == list(theirs), file
            for key, value in ours.items():
                expected = tensor_piece(whole[f"{layer}.{key}"], theirs[key].shape, tensor, tp)
                assert bits_equal(value, expected), (file, key)
    for mp in range(tp):
        states = _load(tag / f"mp_rank_{mp:02d}_model_states.pt")
        assert states["mp_world_size"] == tp and states["dp_world_size"] == 1
        assert states["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": tp}
        assert states["module"] is None
        rules = _load(saved / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
        assert states["universal_checkpoint_info"] == rules  # the source's, as saved: name patterns


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--world-size", "6", "--tensor-parallel", "4"],
            "--world-size 6 is not a multiple of the pipeline degree 2 x --tensor-parallel 4",
        ),
        (
            ["--world-size", "6", "--tensor-parallel", "4", "--pipeline-parallel", "1"],
            "--world-size 6 is not a multiple of --pipeline-parallel 1 x --tensor-parallel 4",
        ),
        (
            ["--world-size", "6", "--tensor-parallel", "3"],
            "2.up.weight has 32 elements along its split axis 0: not a multiple of --tensor-parallel 3",
        ),
        (
            ["--world-size", "8", "--tensor-parallel", "4", "--stage", "2"],
            "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
        ),
        (
            ["--world-size", "24", "--tensor-parallel", "4", "--pipeline-parallel", "6"],
            "the pipeline has 5 layers, fewer than the stages",
        ),
    ],
)
def test_what_is_not_written_is_refused_by_name_before_writing(ds, tmp_path, options, message):
    result = invoke("reshard", ds.path(REFUSED), tmp_path / "out", *options)
    assert result.exit_code != 0 and "CK410" in result.output and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def _plan_with(ds, tmp_path, change):
    """The split of the real tp2 x pp1 source to tp4 planned from its checkpoint index changed by ``change`` (an index
    the describer would not write from these files)."""
    from ckptspec.checkpoint.states import StateCache
    from ckptspec.deepspeed.check.checkpoint_index import validate_index_checkpoint
    from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir
    from ckptspec.export.reshard_tp_pipeline_split import plan_tensor_pipeline_split

    source = ds.path("tp2pp1-s1-fp32-ws2")
    states = StateCache()
    found, _ = validate_index_checkpoint(source, None, None, states=states, verify_hashes=False)
    return plan_tensor_pipeline_split(change(found), resolve_tag_dir(source, None), {}, states, 4, None, 4)


def test_a_layer_key_no_rule_places_is_refused_by_name(ds, tmp_path):
    """A layer file's tensor that is no shard of a parameter, frozen parameter or buffer of the index (here
    ``4.bias``'s, its parameter left out of the index) is not guessed."""
    from ckptspec.errors import ReshardUnsupported

    def without_bias(index):
        return index.model_copy(update={"parameters": [p for p in index.parameters if p.name != "4.bias"]})

    with pytest.raises(
        ReshardUnsupported,
        match=r"layer_04-model_00-model_states.pt: 'bias' is no shard of a parameter, frozen parameter or buffer",
    ):
        _plan_with(ds, tmp_path, without_bias)
