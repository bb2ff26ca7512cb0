"""Issue #40: a tensor x pipeline-parallel checkpoint with a TiedLayerSpec, a frozen parameter and buffers
(scenarios.TP_PIPE_EXTRAS_SPECS, job/tp_layers.py) split to another tensor degree (``reshard --tensor-parallel T``,
export/reshard_tp_pipeline_split.py): tp2 x pp2 -> tp4 x pp1 (split at the source's stages, then restaged), tp2 x pp1
-> tp4 x pp1, and DeepSpeed's own tp4 x pp1 save -> tp2 x pp1, each loaded by a real job of the target layout
(scenarios.TP_PIPE_EXTRAS_RESHARDS, tests/_harness/optim_job.py: its frozen parameters and buffers filled with noise
before ``engine.load_checkpoint``).

The model: the tie (layers 0 and 4: a trained weight, a frozen gain and a buffer, replicated on every tensor rank),
layer 2's column-parallel ``up.weight`` frozen (a shard per tensor rank, split along dim 0 as the layer splits it at any
degree), a buffer in layer 3's tensor-parallel block (replicated).

Ground truth: what the source job gathered whole over its tensor groups from the live engine (masters, Adam moments,
module), cut into T where the target job's own tensor is a T-th of the whole one; each source rank's own buffers and
tie gain; the step and the logits. The files against DeepSpeed's own save of the same model at the target layout.
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

SPLITS = {  # move -> DeepSpeed's own save of the same model at the target layout
    "tp2pp2-s1-fp32-ws4-extras>tp4-pp1": "tp4pp1-s1-fp32-ws4-extras",
    "tp2pp1-s1-fp32-ws2-extras>tp4": "tp4pp1-s1-fp32-ws4-extras",
    "tp4pp1-s1-fp32-ws4-extras>tp2": "tp2pp1-s1-fp32-ws2-extras",
}
CASES = sorted(SPLITS)
TIE, TIE_GAIN, TIE_BUFFER = "0.weight", "tied_modules.emb.gain", "tied_modules.emb.seen"
FROZEN, BUFFER = "2.up.weight", "3.running"
TIED_LAYERS = (0, 4)
# the logits of the fixed batch, as a share of the largest: the row-parallel blocks add T partial sums where the
# source added its own number (another rounding order only)
LOGITS_SHARE = 1e-6


def _source(name):
    return scenarios.TP_PIPE_EXTRAS_RESHARDS[name][0]


def _tp(name):
    return scenarios.reshard_target(name)[2]["tp"]


def _whole(ds, source):
    """Global name -> the source's whole master, moments and module tensor (trainable and frozen), as its ranks
    gathered them over their tensor groups."""
    return gathered_whole(ds.path(source), local_names=True)


def _source_rank(ds, source, layer, tp):
    """The source rank of tensor rank ``tp`` whose stage runs ``layer``."""
    for oracle in rank_oracles(ds.path(source)):
        start, stop = oracle["coords"]["stage_layers"]
        if oracle["coords"]["tp"] == tp and start <= layer < stop:
            return oracle
    raise AssertionError((source, layer, tp))


def _loaded(ds, name):
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert "reshard_error" not in outcome and outcome["load_checkpoint_error"] is None, outcome
    return optim_records(ds.path(name))


def test_every_split_of_an_extras_source_is_checked():
    """The fp32 sources' splits (the bf16 source's: test_reshard_tp_pipe_extras_bf16.py)."""
    moves = scenarios.TP_PIPE_EXTRAS_RESHARDS.items()
    assert sorted(n for n, (s, _, _, o) in moves if o.get("tensor_parallel", 1) > 1 and "-bf16-" not in s) == CASES


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_masters_moments_step_frozen_shards_buffers_and_the_tie(ds, name):
    """Each tensor rank of the target holds its piece of the source's masters and both moments (the tie's whole, under
    its stage name), step 2, its piece of the frozen ``2.up.weight`` (a quarter, or a half, along dim 0), the layer 3
    buffer, and the tie's frozen gain and buffer of the last of its layers the stage runs (layer 4's: DeepSpeed loads a
    stage's layer files in layer order into its one module), all bit for bit; its frozen parameters and buffers held
    noise before loading."""
    records = _loaded(ds, name)
    source, tp = _source(name), _tp(name)
    assert [(r["coords"]["pp"], r["coords"]["tp"]) for r in records] == [(0, t) for t in range(tp)]
    whole = _whole(ds, source)
    assert_pieces_of_whole(records, whole, tp)
    for r in records:
        tensor = r["coords"]["tp"]
        assert TIE in r["master"] and r["master"][TIE].shape == whole["master"][TIE].shape
        expected = {
            FROZEN: tensor_piece(whole["module"][FROZEN], r["module"][FROZEN].shape, tensor, tp),
            BUFFER: _source_rank(ds, source, 3, 0)["buffers"][BUFFER],
            TIE_GAIN: _source_rank(ds, source, 4, 0)["module"][TIE_GAIN],
            TIE_BUFFER: _source_rank(ds, source, 4, 0)["buffers"][TIE_BUFFER],
        }
        assert sorted(r["module"]) == sorted(expected), tensor
        assert list(r["module"][FROZEN].shape) == [32 // tp, 16]  # the target's own shard
        for local, value in expected.items():
            assert bits_equal(r["module"][local], value), (tensor, local)
    source_logits = logits_of(rank_oracles(ds.path(source))).float().numpy()
    off = np.abs(logits_of(records).float().numpy() - source_logits).max()
    assert off <= LOGITS_SHARE * np.abs(source_logits).max(), off


def test_deepspeeds_universal_path_gives_the_same_trainables(ds):
    """The tp4 job loading DeepSpeed's own ``ds_to_universal`` folder of the tp2 x pp2 source (``load_universal``)
    holds the same masters, moments and step as it holds from ckptspec's split (no frozen parameter or buffer: no
    universal folder holds them)."""
    name = "tp2pp2-s1-fp32-ws4-extras>tp4-pp1"
    assert json.loads((ds.path(name) / "optim.json").read_text())["universal_error"] is None
    ours, theirs = _loaded(ds, name), optim_records(ds.path(name), "universal")
    for a, b in zip(ours, theirs, strict=True):
        assert sorted(a["master"]) == sorted(b["master"])
        for n in a["master"]:
            assert bits_equal(a["master"][n], b["master"][n]), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(a["state"][n][key], b["state"][n][key]), (n, key)
            assert a["step"][n] == b["step"][n], n


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("name", CASES)
def test_the_files_are_deepspeeds_at_the_target_layout(ds, name):
    """The written tag against DeepSpeed's own save of the same model at the target layout: the same file names; the
    layer and optimizer files' keys, tensor shapes and dtypes; the model states' keys, degrees, ``buffer_names`` (the
    tie's buffer once, first), ``param_shapes`` (the tie first under its stage name, the frozen weight out), the saved
    split rules and ``ds_config``."""
    saved = SPLITS[name]
    assert scenarios.SOURCE_SPECS[saved][1] == scenarios.TP_PIPE_EXTRAS_RESHARDS[name][1]
    ours = ds.path(name) / "resharded" / "global_step2"
    theirs = ds.path(saved) / info(ds.path(saved))["tag"]
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for file in names:
        a, b = _load(theirs / file), _load(ours / file)
        if file.startswith("layer_"):
            assert structure(a) == structure(b), file
        elif "model_states" in file:
            assert sorted(a) == sorted(b), file
            for key in a:
                if key == "param_shapes":
                    assert [dict(s) for s in a[key]] == [dict(s) for s in b[key]], file
                else:
                    assert a[key] == b[key], (file, key)
            assert a["buffer_names"] == ["tied_modules.emb.seen", BUFFER] and next(iter(a["param_shapes"][0])) == (
                "tied_modules.emb.weight"
            )
        else:
            assert structure(a["optimizer_state_dict"]) == structure(b["optimizer_state_dict"]), file


@pytest.mark.parametrize("name", CASES)
def test_the_layer_files_hold_the_pieces_and_each_tie_layer_its_own_copy(ds, name):
    """Each ``layer_LL-model_TT`` file holds tensor rank TT's piece of the source's module (the frozen weight's piece
    included), bit for bit, its keys the saved file's in order; layers 0 and 4 the tie's weight whole and the gain and
    buffer of the source stage that ran that layer (tp2 x pp2: stage 0's and stage 1's, which differ); layer 3 the
    buffer."""
    source, tp = _source(name), _tp(name)
    tag = ds.path(name) / "resharded" / "global_step2"
    saved = ds.path(SPLITS[name]) / info(ds.path(SPLITS[name]))["tag"]
    whole = _whole(ds, source)["module"]
    for layer in range(6):
        for tensor in range(tp):
            file = f"layer_{layer:02d}-model_{tensor:02d}-model_states.pt"
            ours, theirs = torch.load(tag / file, weights_only=True), torch.load(saved / file, weights_only=True)
            assert list(ours) == list(theirs), file
            for key, value in ours.items():
                if layer in TIED_LAYERS:
                    rank = _source_rank(ds, source, layer, 0)
                    local = f"tied_modules.emb.{key}"
                    expected = rank["buffers"][local] if key == "seen" else rank["module"][local]
                elif key == "running":
                    expected = _source_rank(ds, source, layer, 0)["buffers"][f"{layer}.{key}"]
                else:
                    expected = tensor_piece(whole[f"{layer}.{key}"], theirs[key].shape, tensor, tp)
                assert bits_equal(value, expected), (file, key)
    if source.startswith("tp2pp2"):  # each stage's forward updated its own copy of the tie's buffer
        seen = [torch.load(tag / f"layer_{i:02d}-model_00-model_states.pt", weights_only=True)["seen"] for i in (0, 4)]
        assert not bits_equal(*seen)


def test_a_degree_the_frozen_weight_cannot_be_split_by_is_refused_before_writing(ds, tmp_path):
    """``--tensor-parallel 3``: 32 rows (the column-parallel layers' and the frozen weight's) do not split into 3:
    CK410 naming the first such tensor, nothing written."""
    source = ds.path("tp2pp1-s1-fp32-ws2-extras")
    result = invoke("reshard", source, tmp_path / "out", "--tensor-parallel", "3", "--world-size", "3")
    assert result.exit_code == 1 and "CK410" in result.output, result.output
    assert "has 32 elements along its split axis 0: not a multiple of --tensor-parallel 3" in result.output
    assert not (tmp_path / "out").exists()
