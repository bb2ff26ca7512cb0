"""Issue #40: a tensor x pipeline-parallel checkpoint with a TiedLayerSpec, a frozen parameter and buffers
(``tp2pp2-s1-fp32-ws4-extras``: scenarios.TP_PIPE_EXTRAS_SPECS, job/tp_layers.py) read, merged, restaged and exported.

The source: Megatron-style column/row-parallel blocks (layers 2 and 3) in a PipelineModule over a
PipeModelDataParallelTopology (tp2 x pp2), the plain pipeline's TiedLayerSpec at layers 0 and 4 (replicated on every
tensor rank, with a frozen gain and a buffer of its own: each stage's copy of that buffer is the stage's), layer 2's
column-parallel ``up.weight`` frozen (a shard per tensor rank), a buffer in layer 3's block.

Ground truth: what the source job recorded from the live engine (each rank's masters, module and buffers; the
masters, module and Adam moments gathered whole over its tensor group) and what real DeepSpeed target jobs hold after
``engine.load_checkpoint`` of ckptspec's output (scenarios.TP_PIPE_EXTRAS_RESHARDS, tests/_harness/optim_job.py: the
frozen parameters and buffers filled with noise first, before_load.py).
"""

import json

import numpy as np
import pytest
import torch
from _harness import scenarios
from _harness.job.parallel_models import normalize
from _harness.parallel_oracles import (
    assert_universal_folders_equal,
    bits_equal,
    info,
    logits_of,
    optim_records,
    rank_oracles,
    structure,
)
from _harness.reconstruction import invoke
from safetensors.torch import load_file

SOURCE = "tp2pp2-s1-fp32-ws4-extras"
MERGE, STAGES, UNIVERSAL = (f"{SOURCE}>tp1", f"{SOURCE}>pp1", f"{SOURCE}>universal-tp1")
BOTH = f"{SOURCE}>tp1-pp1"  # merged, then moved to one stage
ONE_STAGE = "tp2pp1-s1-fp32-ws2-extras"  # DeepSpeed's save of the same model at tp2 x pp1
REVERSE = f"{ONE_STAGE}>pp2"  # moved to two stages
TIE, TIE_GAIN, TIE_BUFFER = "tied_modules.emb.weight", "tied_modules.emb.gain", "tied_modules.emb.seen"
FROZEN, BUFFER = "2.up.weight", "3.running"
# the index's extras: the frozen weight split like up.weight, the tie's gain and buffer one per layer file
EXTRAS = {FROZEN: "frozen", BUFFER: "buffer", "0.gain": "frozen", "4.gain": "frozen"}
EXTRAS.update({"0.seen": "buffer", "4.seen": "buffer"})
LOGITS_SHARE = 1e-6  # fp32: the merged blocks sum in one matmul what the source summed over two tensor ranks


def _oracles(ds, source=SOURCE):
    return rank_oracles(ds.path(source))


def _global(oracle, local):
    return oracle["params"][local]["global_name"]


def _whole(ds):
    """Global name -> the source's whole master, moments and module tensor (every holder's the same)."""
    out: dict = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}, "module": {}}
    for oracle in _oracles(ds):
        values = {"master": oracle["whole_masters"], "module": oracle["whole_module"], **oracle["whole_moments"]}
        for key, by_local in values.items():
            for local, value in by_local.items():
                name = _global(oracle, local)
                assert name not in out[key] or bits_equal(out[key][name], value), (key, name)
                out[key][name] = value
    return out


def _source_rank(ds, pp, tp, source=SOURCE):
    return next(o for o in _oracles(ds, source) if (o["coords"]["pp"], o["coords"]["tp"]) == (pp, tp))


def _loaded(ds, name):
    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert "reshard_error" not in outcome and outcome["load_checkpoint_error"] is None, outcome
    return optim_records(ds.path(name))


def test_every_move_of_the_source_is_checked():
    """Here: the fp32 sources' moves at the source's tensor degree, or merged (the splits:
    test_reshard_tp_pipe_split_extras.py; the bf16 source's: test_reshard_tp_pipe_extras_bf16.py)."""
    moves = scenarios.TP_PIPE_EXTRAS_RESHARDS
    here = [n for n, (s, _, _, o) in moves.items() if o.get("tensor_parallel", 1) == 1 and "-bf16-" not in s]
    assert sorted(here) == sorted([MERGE, STAGES, UNIVERSAL, BOTH, REVERSE])
    assert [moves[n][0] for n in here].count(SOURCE) == 4


def test_the_source_holds_a_tie_on_both_stages_and_tensor_ranks_a_frozen_shard_and_buffers(ds):
    """What the index must describe, as DeepSpeed saved it: six layers (two per tensor rank each), the tie trained
    on every rank with one value, the frozen weight a shard per tensor rank, each stage's tie buffer its own."""
    tag = ds.path(SOURCE) / info(ds.path(SOURCE))["tag"]
    layers = sorted(p.name for p in tag.glob("layer_*"))
    assert layers == [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(6) for t in range(2)]
    oracles = _oracles(ds)
    ties = [o["masters"][TIE] for o in oracles]
    assert len(ties) == 4 and all(bits_equal(t, ties[0]) for t in ties)
    frozen = [o["module"][FROZEN] for o in oracles if FROZEN in o["module"]]
    assert [list(f.shape) for f in frozen] == [[16, 16], [16, 16]] and not bits_equal(frozen[0], frozen[1])
    seen = {o["coords"]["pp"]: o["buffers"][TIE_BUFFER] for o in oracles}
    assert not bits_equal(seen[0], seen[1])  # each stage's forward updated its own copy


def test_validate_generate_and_reconstruct_read_the_tie_frozen_weight_and_buffers(ds, tmp_path):
    result = invoke("validate", ds.path(SOURCE))
    assert result.exit_code == 0 and result.stdout.strip().endswith("valid"), result.stdout
    assert invoke("generate", ds.path(SOURCE), "-o", tmp_path / "index.json").exit_code == 0
    doc = json.loads((tmp_path / "index.json").read_text())
    assert doc["aliases"] == {"4.weight": "0.weight"}
    extras = {e["name"]: e for e in doc["extras"]}
    assert {n: e["role"] for n, e in extras.items()} == EXTRAS
    assert [s["placement"] for s in extras[FROZEN]["shards"]] == [
        {"split": {"axis": 0, "offset": t * 16, "length": 16}} for t in range(2)
    ]
    for name in set(EXTRAS) - {FROZEN}:
        assert [(s["placement"], s["primary"]) for s in extras[name]["shards"]] == [("replicated", True)] + [
            ("replicated", False)
        ], name
    tie = next(p for p in doc["parameters"] if p["name"] == "0.weight")
    assert sorted((s["domain"], s["primary"]) for s in tie["shards"]) == [
        ("pp0-tp0", True),
        ("pp0-tp1", False),
        ("pp1-tp0", False),
        ("pp1-tp1", False),
    ]
    assert invoke("validate", tmp_path / "index.json", "--checkpoint", ds.path(SOURCE)).exit_code == 0
    result = invoke("reconstruct", ds.path(SOURCE), tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 0, result.output
    model, optimizer = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(tmp_path / "out" / "optimizer.safetensors"),
    )
    whole = _whole(ds)
    for name, master in whole["master"].items():
        assert bits_equal(model[name], master), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(optimizer[f"{name}.{key}"], whole[key][name]), (name, key)
    assert bits_equal(model[FROZEN], whole["module"][FROZEN])
    assert bits_equal(model[BUFFER], _source_rank(ds, 1, 0)["buffers"][BUFFER])
    for layer, stage in ((0, 0), (4, 1)):  # each layer file's copy of the tie's gain and buffer
        assert bits_equal(model[f"{layer}.seen"], _source_rank(ds, stage, 0)["buffers"][TIE_BUFFER])
        assert bits_equal(model[f"{layer}.gain"], _source_rank(ds, stage, 0)["module"][TIE_GAIN])


def _check_trainables(records, expected):
    """Every target rank's masters, moments and step: ``expected[(tensor rank, global name)]``."""
    held = set()
    for r in records:
        for name, master in r["master"].items():
            key = (r["coords"]["tp"], name)
            held.add(key)
            assert bits_equal(master, expected[key]["master"]), key
            for moment in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(r["state"][name][moment], expected[key][moment]), (key, moment)
            assert r["step"][name] == 2.0 and r["source"][name] == "safe_get_full_optimizer_state", key
    assert held == set(expected)


def _merged_expected(ds):
    whole = _whole(ds)
    return {(0, n): {k: whole[k][n] for k in ("master", "exp_avg", "exp_avg_sq")} for n in whole["master"]}


def _kept_expected(ds, source=SOURCE):
    """(tensor rank, global name) -> the source rank's own master and its shard of the whole moments."""
    out = {}
    for oracle in _oracles(ds, source):
        tp = oracle["coords"]["tp"]
        for local, master in oracle["masters"].items():
            entry = {"master": master}
            for key in ("exp_avg", "exp_avg_sq"):
                value = oracle["whole_moments"][key][local]
                axes = [i for i, (a, b) in enumerate(zip(master.shape, value.shape, strict=True)) if a != b]
                entry[key] = value.chunk(2, dim=axes[0])[tp] if axes else value
            out[tp, _global(oracle, local)] = entry
    return out


@pytest.mark.parametrize("name", [MERGE, STAGES, BOTH])
def test_the_target_job_holds_the_masters_moments_step_tie_frozen_weight_and_buffers(ds, name):
    """Merged (tp1 x pp2), at one stage keeping tp2 (tp2 x pp1) or both (tp1 x pp1 x dp2): each target rank holds the
    source's masters and
    moments of its tensors (the tie's on every stage running it), the step, the frozen weight (whole, or its tensor
    rank's shard), the layer 3 buffer and, on each stage running the tie, the gain and buffer of the last of its
    layers it runs (DeepSpeed loads a stage's layer files in layer order into its one module): merged, each stage's
    own; at one stage, layer 4's (the source's stage 1). The frozen parameters and buffers held noise before loading."""
    records = _loaded(ds, name)
    merged = name != STAGES
    _check_trainables(records, _merged_expected(ds) if merged else _kept_expected(ds))
    whole = _whole(ds)
    frozen_seen, tie_stages = 0, set()
    for r in records:
        pp, tp = r["coords"]["pp"], r["coords"]["tp"]
        start, stop = r["coords"]["stage_layers"]
        if start <= 2 < stop:
            expected = whole["module"][FROZEN] if merged else _source_rank(ds, 0, tp)["module"][FROZEN]
            assert bits_equal(r["module"][FROZEN], expected), (pp, tp)
            frozen_seen += 1
        if start <= 3 < stop:
            assert bits_equal(r["module"][BUFFER], _source_rank(ds, 1, tp)["buffers"][BUFFER]), (pp, tp)
        last = max(layer for layer in (0, 4) if start <= layer < stop)
        source = _source_rank(ds, 0 if last == 0 else 1, tp)
        assert bits_equal(r["module"][TIE_BUFFER], source["buffers"][TIE_BUFFER]), (pp, tp)
        assert bits_equal(r["module"][TIE_GAIN], source["module"][TIE_GAIN]), (pp, tp)
        assert bits_equal(r["master"]["0.weight"], whole["master"]["0.weight"]) or not merged
        tie_stages.add(pp)
    assert frozen_seen == (1 if name == MERGE else 2) and tie_stages == ({0, 1} if name == MERGE else {0})
    source_logits = logits_of(_oracles(ds))
    off = np.abs(logits_of(records).float().numpy() - source_logits.float().numpy()).max()
    assert off <= LOGITS_SHARE * np.abs(source_logits.float().numpy()).max(), off


def test_the_merged_layer_files_are_a_tp1_pipelines_and_each_stage_names_its_tie_and_buffers(ds):
    tag = ds.path(MERGE) / "resharded" / "global_step2"
    whole = _whole(ds)["module"]
    assert sorted(p.name for p in tag.glob("layer_*")) == [f"layer_{i:02d}-model_states.pt" for i in range(6)]
    saved = {i: torch.load(tag / f"layer_{i:02d}-model_states.pt", weights_only=True) for i in range(6)}
    assert sorted(saved[0]) == sorted(saved[4]) == ["gain", "seen", "weight"]
    assert bits_equal(saved[0]["weight"], whole["0.weight"]) and bits_equal(saved[4]["weight"], whole["0.weight"])
    assert bits_equal(saved[2]["up.weight"], whole[FROZEN]) and sorted(saved[3]) == [
        "down.bias",
        "down.weight",
        "running",
        "up.bias",
        "up.weight",
    ]
    for stage, buffers in enumerate([[TIE_BUFFER], [TIE_BUFFER, BUFFER]]):
        states = torch.load(tag / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)
        assert states["buffer_names"] == buffers and states["mp_world_size"] == 2
        assert next(iter(states["param_shapes"][0])) == TIE  # the stage's optimizer: the tied module first


def test_a_job_loading_the_universal_folder_holds_the_masters_moments_step_and_tie(ds):
    """ckptspec's folder (export-universal), loaded with load_universal by the tp1 x pp2 job: the masters, moments and
    step bit for bit, the tie on both stages from one folder (``zero/tied_modules.emb.weight/``). Neither the frozen
    weights nor the buffers: they are in the layer files, which no universal folder holds (DeepSpeed's universal load
    keeps the job's own)."""
    records = _loaded(ds, UNIVERSAL)
    _check_trainables(records, _merged_expected(ds))
    folder = ds.path(UNIVERSAL) / "resharded" / "universal" / "zero"
    assert (folder / TIE).is_dir() and not (folder / "0.weight").exists()
    assert "cat_dim" not in torch.load(folder / TIE / "fp32.pt", weights_only=False)  # replicated: no split dim
    assert torch.load(folder / "2.down.weight" / "fp32.pt", weights_only=False)["cat_dim"] == 1
    assert not (folder / FROZEN).exists() and not (folder / BUFFER).exists()


def test_ckptspecs_universal_folder_is_ds_to_universals_file_for_file(ds):
    """DeepSpeed's ds_to_universal converts this source (the tie's stage name matches a replicated pattern): its
    folder and ckptspec's hold the same files (the tie once, no frozen weight or buffer), the same tensors bit for
    bit, the model states byte for byte."""
    ours = ds.path(UNIVERSAL) / "resharded" / "universal"
    theirs = ds.path(SOURCE) / info(ds.path(SOURCE))["universal"]["output_folder"]
    assert_universal_folders_equal(ours, theirs, 45)


@pytest.mark.parametrize("name", [MERGE, UNIVERSAL, BOTH])
def test_deepspeeds_universal_path_gives_the_same_masters_moments_and_step(ds, name):
    """The same tp1 target job (pp2, or pp1) loading ds_to_universal's folder of the source (load_universal)."""
    assert json.loads((ds.path(name) / "optim.json").read_text())["universal_error"] is None
    _check_trainables(optim_records(ds.path(name), "universal"), _merged_expected(ds))


def test_at_one_stage_each_tensor_rank_names_the_tie_and_its_buffer_once(ds):
    """tp2 x pp1: each tensor rank's one stage runs both of the tie's layers and trains one tied module: its model
    states name the tie first in the optimizer and its buffer once, then layer 3's (DeepSpeed's ``buffer_names``, the
    module's ``named_buffers``: a module reached twice is listed once), as the source stages named theirs."""
    tag = ds.path(STAGES) / "resharded" / "global_step2"
    source = ds.path(SOURCE) / info(ds.path(SOURCE))["tag"]
    saved = [torch.load(source / f"mp_rank_{mp:02d}_model_states.pt", weights_only=False) for mp in range(4)]
    assert [s["buffer_names"] for s in saved] == [[TIE_BUFFER]] * 2 + [[TIE_BUFFER, BUFFER]] * 2
    for tensor in range(2):
        states = torch.load(tag / f"mp_rank_{tensor:02d}_model_states.pt", weights_only=False)
        assert states["buffer_names"] == [TIE_BUFFER, BUFFER] and states["mp_world_size"] == 2
        assert list(states["param_shapes"][0])[:2] == [TIE, "2.up.bias"]  # the tie first, layer 2's frozen weight out


@pytest.mark.parametrize("move", [["--pipeline-parallel", "1"], ["--tensor-parallel", "1"]])
def test_a_tie_whose_copy_on_one_stage_differs_is_refused_before_writing(ds, tmp_path, move):
    """Each target stage running the tie is given one copy of its master and moments: a stage-1 copy of its first
    moment that differs from stage 0's (tensor rank 0's optimizer file at mp_rank 02; a changed master is its layer
    file's CK235 already) is refused by the validation every command starts with (CK237, naming the file), nothing
    written; the merge's own comparison (CK401) stays behind it."""
    import shutil

    src = ds.path(SOURCE) / info(ds.path(SOURCE))["tag"]
    tag = tmp_path / "ckpt" / src.name
    shutil.copytree(src, tag)
    (tmp_path / "ckpt" / "latest").write_text(src.name)
    path = tag / "zero_pp_rank_0_mp_rank_02_optim_states.pt"
    saved = torch.load(path, weights_only=False)
    saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][0] += 1  # the tie's first element
    torch.save(saved, path)
    result = invoke("reshard", tmp_path / "ckpt", tmp_path / "out", *move, "--world-size", "2")
    assert result.exit_code == 1 and "CK237" in result.output and "0.weight" in result.output, result.output
    assert "zero_pp_rank_0_mp_rank_02_optim_states.pt" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_tie_the_rules_split_over_the_tensor_ranks_is_refused_by_name(ds, tmp_path):
    """The rules must name a TiedLayerSpec's parameters replicated: without the pattern, ``0.weight`` would be split
    along dim 0 over the tensor ranks of every stage (each stage's copies a whole set of shards), which is not
    described (CK202, nothing written)."""
    import shutil

    src = ds.path(SOURCE) / info(ds.path(SOURCE))["tag"]
    tag = tmp_path / "ckpt" / src.name
    shutil.copytree(src, tag)
    (tmp_path / "ckpt" / "latest").write_text(src.name)
    for mp in range(4):
        path = tag / f"mp_rank_{mp:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        rules = states["universal_checkpoint_info"]["tp_replicated_parameter_patterns"]
        rules[:] = [r for r in rules if "tied_modules" not in r]
        torch.save(states, path)
    result = invoke("reshard", tmp_path / "ckpt", tmp_path / "out", "--tensor-parallel", "1", "--world-size", "2")
    assert result.exit_code == 1 and "CK202" in result.output, result.output
    assert "the tied '0.weight' is split over the tensor ranks" in result.output
    assert not (tmp_path / "out").exists()


# DeepSpeed's own saves of the same model at each target's layout and world size: the plain pipeline's extras model
# (EXTRAS_SPECS, PIPE_TARGET_SPECS) for the merges, its tp2 x pp1 save (TP_PIPE_EXTRAS_SPECS) for the move
SAVED = {MERGE: "pp2-s1-fp32-ws2-extras", BOTH: "pp1-s1-fp32-ws2-extras", STAGES: ONE_STAGE, REVERSE: SOURCE}


@pytest.mark.parametrize("name", sorted(SAVED))
def test_the_files_are_deepspeeds_at_the_target_layout(ds, name):
    """What ckptspec wrote against DeepSpeed's own save of the same model at the target layout: the same file names;
    the layer files' and optimizer files' keys and tensor shapes; the model states' degrees, ``buffer_names`` (the
    tie's buffer once, first), ``param_shapes`` (the tie first, under its stage name) the same."""
    saved = SAVED[name]
    assert scenarios.SOURCE_SPECS[saved][1] == scenarios.TP_PIPE_EXTRAS_RESHARDS[name][1]
    conversion = ("universal", "inject_missing_state")  # what the saving job did after the save
    same = [normalize(scenarios.source_spec(saved)), normalize(scenarios.reshard_target(name)[2])]
    kept = [{k: v for k, v in spec.items() if k not in conversion} for spec in same]
    assert kept[0] == kept[1]
    ours = ds.path(name) / "resharded" / "global_step2"
    theirs = ds.path(saved) / info(ds.path(saved))["tag"]
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for file in names:
        a, b = torch.load(theirs / file, weights_only=False), torch.load(ours / file, weights_only=False)
        if file.startswith("layer_"):
            assert structure(a) == structure(b), file
        elif "model_states" in file:
            for key in ("mp_world_size", "dp_world_size", "checkpoint_parallel_dimensions", "buffer_names", "module"):
                assert a.get(key) == b.get(key), (file, key)
            assert [dict(s) for s in a["param_shapes"]] == [dict(s) for s in b["param_shapes"]], file
        else:
            assert structure(a["optimizer_state_dict"]) == structure(b["optimizer_state_dict"]), file


def test_a_tp2_pp1_save_moved_to_two_stages_gives_each_stage_the_one_tied_modules_copy(ds):
    """DeepSpeed's tp2 x pp1 save of the model (one tied module per tensor rank, run at layers 0 and 4) moved to
    tp2 x pp2 (``--pipeline-parallel 2``): a real job of that layout holds each tensor rank's masters and moments as
    the saving job held them (the tie's on both stages), the step, the frozen shard, and on both stages the one
    module's gain and buffer (the same value in both of its layer files); its frozen parameters and buffers held noise
    before loading."""
    records = _loaded(ds, REVERSE)
    _check_trainables(records, _kept_expected(ds, ONE_STAGE))
    stages = set()
    for r in records:
        pp, tp = r["coords"]["pp"], r["coords"]["tp"]
        start, stop = r["coords"]["stage_layers"]
        source = _source_rank(ds, 0, tp, ONE_STAGE)
        expected = {TIE_GAIN: source["module"][TIE_GAIN], TIE_BUFFER: source["buffers"][TIE_BUFFER]}
        if start <= 2 < stop:
            expected[FROZEN] = source["module"][FROZEN]
        if start <= 3 < stop:
            expected[BUFFER] = source["buffers"][BUFFER]
        assert sorted(r["module"]) == sorted(expected), (pp, tp)
        for local, value in expected.items():
            assert bits_equal(r["module"][local], value), (pp, tp, local)
        assert "0.weight" in r["master"]
        stages.add(pp)
    assert stages == {0, 1}
    source_logits = logits_of(_oracles(ds, ONE_STAGE))
    off = np.abs(logits_of(records).float().numpy() - source_logits.float().numpy()).max()
    assert off <= LOGITS_SHARE * np.abs(source_logits.float().numpy()).max(), off
