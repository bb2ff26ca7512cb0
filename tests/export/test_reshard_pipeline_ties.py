"""#40: a PipelineModule's ties (TiedLayerSpec), frozen parameters and buffers moved to another number of stages.

The source (``pp2-s1-fp32-ws2-extras``): two stages, a TiedLayerSpec run at layers 0 and 4 (one module per stage,
each trained there, with a frozen gain and a persistent buffer of its own: each stage's copy of the buffer holds
that stage's value, PipelineModule synchronizes the tied weight alone), a frozen weight in layer 2 and a persistent
buffer in layer 3. ``ckptspec reshard
--pipeline-parallel 1`` and ``3`` (DEGREE_RESHARDS), loaded by real DeepSpeed jobs of the target layout
(tests/_harness/optim_job.py). test_reshard_pipeline.py checks the masters and moments bit for bit; here: what
the layer files and each stage's model states hold, and what ckptspec reads of them, against the source's files
and the target jobs' own records. Its universal folder (``export-universal``, loaded by a pp2 x dp2 job beside
DeepSpeed's own ``ds_to_universal`` folder; test_universal_parallel.py checks both bit for bit and file for file):
the tie, the frozen weight and the buffer as that job holds them.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _harness.before_load import noise
from _harness.parallel_oracles import optim_records
from _harness.scenarios import DEGREE_RESHARDS
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli
from ckptspec.errors import ReshardUnsupported
from ckptspec.export.reshard_pipeline import _bounds
from ckptspec.export.reshard_pipeline_layers import PipelineLayers

SOURCE = "pp2-s1-fp32-ws2-extras"
ONE_STAGE = "pp1-s1-fp32-ws2-extras"  # the same model's real pp1 save: one tied module, one value in both files
CASES = sorted(
    n
    for n, (source, *_, options) in DEGREE_RESHARDS.items()
    if source in (SOURCE, ONE_STAGE) and "pipeline_parallel" in options
)
FROZEN, BUFFER, TIED = "2.up.weight", "3.running", ("layer_00-model_states.pt", "layer_04-model_states.pt")
TIE_LAYERS, TIE_FROZEN, TIE_BUFFER = (0, 4), "tied_modules.emb.gain", "tied_modules.emb.seen"  # the tie's, local names
EXTRAS = {FROZEN: "frozen", BUFFER: "buffer", **{f"{layer}.gain": "frozen" for layer in TIE_LAYERS}}
EXTRAS.update({f"{layer}.seen": "buffer" for layer in TIE_LAYERS})
UNIVERSAL = f"{SOURCE}>universal-ws4"


def _tag(path):
    return path / (path / "latest").read_text().strip()


def _bits(tensor) -> bytes:
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


def test_both_moves_are_checked():
    assert CASES == [f"{ONE_STAGE}>pp2", f"{SOURCE}>pp1", f"{SOURCE}>pp3"]


@pytest.mark.parametrize("name", CASES)
def test_the_layer_files_hold_the_sources_frozen_weight_buffer_and_both_tied_copies(name, ds):
    """Every layer file of the output holds the source's tensors bit for bit (the frozen weight, the buffer, the
    tie's copy at layer 0 and at layer 4, its gain and buffer included); the target job that loaded it holds the
    source's frozen weight and buffer, and the tie's master equals both copies. Each target stage's tied module
    holds the gain and buffer of the last of the tie's layers it runs (DeepSpeed loads a stage's layer files in
    layer order into its one module): at pp1 layer 4's, at pp3 layer 0's on stage 0 and layer 4's on stage 2. The
    source's two copies of the buffer differ, so a stage given the other copy would fail."""
    source, out = _tag(ds.path(DEGREE_RESHARDS[name][0])), _tag(ds.path(name) / "resharded")
    names = sorted(p.name for p in source.glob("layer_*.pt"))
    assert names == sorted(p.name for p in out.glob("layer_*.pt")) and set(TIED) <= set(names)
    saved = {}
    for file in names:
        ours, theirs = torch.load(out / file), torch.load(source / file)
        assert list(ours) == list(theirs), file
        for key, tensor in theirs.items():
            assert ours[key].dtype == tensor.dtype and _bits(ours[key]) == _bits(tensor), (file, key)
            saved[f"{int(file[6:8])}.{key}"] = tensor
    assert _bits(saved["0.weight"]) == _bits(saved["4.weight"])  # the source's two stages saved one value
    records = optim_records(ds.path(name))
    loaded = {n: t for r in records for n, t in r["module"].items()}
    assert {FROZEN, BUFFER} <= set(loaded)
    for key in (FROZEN, BUFFER):
        assert _bits(loaded[key]) == _bits(saved[key]), key
    masters = [r["master"]["0.weight"] for r in records if "0.weight" in r["master"]]
    assert masters and all(_bits(m) == _bits(saved["0.weight"]) for m in masters)
    # each source stage's forward updated its own copy; a one-stage source's one module saved one value twice
    assert (_bits(saved["0.seen"]) == _bits(saved["4.seen"])) == (DEGREE_RESHARDS[name][0] == ONE_STAGE)
    lasts = set()  # the tie's layer whose copy each stage running the tie holds
    for record in records:
        start, stop = record["coords"]["stage_layers"]
        runs = [layer for layer in TIE_LAYERS if start <= layer < stop]
        assert (TIE_BUFFER in record["module"]) == bool(runs), record["coords"]
        if runs:
            lasts.add(runs[-1])
            for local, key in ((TIE_FROZEN, "gain"), (TIE_BUFFER, "seen")):
                assert _bits(record["module"][local]) == _bits(saved[f"{runs[-1]}.{key}"]), (record["coords"], local)
    assert lasts == ({4} if name.endswith(">pp1") else {0, 4})


@pytest.mark.parametrize("name", CASES)
def test_each_stage_records_its_own_trainables_and_buffers_as_the_target_job_holds_them(name, ds):
    """Each target stage's model states: ``param_shapes`` in the order the target job's stage holds its trainable
    parameters (the tied module first), ``buffer_names`` the source's buffers of the layers the target job's stage
    runs (DeepSpeed's own partition: its tied module's first, once), ``mp_world_size`` the stages."""
    source, out = _tag(ds.path(DEGREE_RESHARDS[name][0])), _tag(ds.path(name) / "resharded")
    buffers = [torch.load(f)["buffer_names"] for f in sorted(source.glob("mp_rank_*_model_states.pt"))]
    one = DEGREE_RESHARDS[name][0] == ONE_STAGE
    assert buffers == ([[TIE_BUFFER, BUFFER]] if one else [[TIE_BUFFER], [TIE_BUFFER, BUFFER]])  # the tie's first
    records = optim_records(ds.path(name))
    stages = sorted({r["coords"]["pp"] for r in records})
    for record in records:
        pp, (start, stop) = record["coords"]["pp"], record["coords"]["stage_layers"]
        state = torch.load(out / f"mp_rank_{pp:02d}_model_states.pt", weights_only=False)
        assert state["mp_world_size"] == len(stages) and state["module"] is None
        held = [n for group in state["param_shapes"] for n in group]
        global_names = ["0." + n.split(".", 2)[2] if n.startswith("tied_modules.") else n for n in held]
        assert global_names == list(record["master"]), (pp, held)
        tie = [TIE_BUFFER] if any(start <= layer < stop for layer in TIE_LAYERS) else []
        assert state["buffer_names"] == tie + ([BUFFER] if start <= 3 < stop else []), pp


@pytest.mark.parametrize("name", CASES)
def test_ckptspec_reads_the_frozen_weight_buffer_and_tie_where_the_target_job_runs_them(name, ds):
    """The output's checkpoint index: the frozen weight a frozen parameter and the buffer a buffer (as the source's
    index has them: a stage whose buffer_names missed it would index it as frozen), the tie an alias of its first
    layer, its gain and buffer one extra per layer file (``<layer>.gain``, ``<layer>.seen``: the copies may differ)
    under the tied module's local name, and every layer file on the stage whose target job runs it (a layer
    holding only the tie at a stage boundary: the stage that trains the tie)."""
    before = ckptspec.open(ds.path(DEGREE_RESHARDS[name][0])).index
    after = ckptspec.open(ds.path(name) / "resharded").index
    assert {e.name: e.role for e in after.extras} == {e.name: e.role for e in before.extras} == EXTRAS
    local = {e.name: [s.local_name for s in e.shards] for e in after.extras}
    assert all(
        local[f"{layer}.{key}"] == [f"tied_modules.emb.{key}"] for layer in TIE_LAYERS for key in ("gain", "seen")
    )
    assert after.aliases == before.aliases == {"4.weight": "0.weight"}
    runs = {}
    for record in optim_records(ds.path(name)):
        start, stop = record["coords"]["stage_layers"]
        runs.update({layer: record["coords"]["pp"] for layer in range(start, stop)})
    assert {f.layer: f.pipeline for f in after.layer_files} == runs
    assert {e.name: e.shards[0].domain for e in after.extras} == {n: f"pp{runs[int(n[0])]}-tp0" for n in EXTRAS}
    tie = next(p for p in after.parameters if p.name == "0.weight")
    stages = {s.domain for s in tie.shards}
    assert stages == {f"pp{runs[0]}-tp0", f"pp{runs[4]}-tp0"}


def test_a_job_loading_the_universal_folder_trains_the_tie_on_both_stages_and_keeps_its_own_module(ds):
    """The folder holds the tie once (``zero/tied_modules.emb.weight/``, the name both stages train it under), equal
    to both stages' saved copies, and neither the frozen weights nor the buffers: they are in the layer files, which
    neither ckptspec's nor DeepSpeed's folder holds. The pp2 x dp2 job loading either holds the tie's master on both
    stages, the source's; its module is its own, as DeepSpeed's universal load never reads one: the frozen weight
    and the tie's gain equal the source's only because the job builds them alike (and keeps them), and the buffers
    (the tie's on each stage too) are exactly what the job put there before loading (before_load.py), not the
    source's (``ckptspec reshard`` carries them: the tests above)."""
    saved = {
        f"{int(f.name[6:8])}.{k}": t for f in _tag(ds.path(SOURCE)).glob("layer_*.pt") for k, t in torch.load(f).items()
    }
    zero = ds.path(UNIVERSAL) / "resharded" / "universal" / "zero"
    tie = torch.load(zero / "tied_modules.emb.weight" / "fp32.pt")["param"]
    assert _bits(tie) == _bits(saved["0.weight"]) == _bits(saved["4.weight"])
    assert {p.name for p in zero.iterdir()} & {FROZEN, BUFFER, *EXTRAS, TIE_FROZEN, TIE_BUFFER, "0.weight"} == set()
    ours, theirs = optim_records(ds.path(UNIVERSAL)), optim_records(ds.path(UNIVERSAL), "universal")
    assert sorted(r["coords"]["pp"] for r in ours) == [0, 0, 1, 1]
    for records in (ours, theirs):
        assert all(_bits(r["master"]["0.weight"]) == _bits(saved["0.weight"]) for r in records)
        module = {}
        for r in records:
            for key, tensor in r["module"].items():  # (stage, local name): the tie's copies are each stage's
                assert _bits(module.setdefault((r["coords"]["pp"], key), tensor)) == _bits(tensor), key  # data ranks
        assert sorted(module) == [
            (0, FROZEN),
            (0, TIE_FROZEN),
            (0, TIE_BUFFER),
            (1, BUFFER),
            (1, TIE_FROZEN),
            (1, TIE_BUFFER),
        ]
        assert _bits(module[0, FROZEN]) == _bits(saved[FROZEN])
        assert _bits(module[1, BUFFER]) == _bits(noise(BUFFER, saved[BUFFER])) != _bits(saved[BUFFER])
        for stage, layer in enumerate(TIE_LAYERS):
            assert _bits(module[stage, TIE_FROZEN]) == _bits(saved[f"{layer}.gain"])
            seen = saved[f"{layer}.seen"]
            assert _bits(module[stage, TIE_BUFFER]) == _bits(noise(TIE_BUFFER, seen)) != _bits(seen)


@pytest.mark.parametrize(
    "command", [["reshard", "--world-size", "2", "--pipeline-parallel", "1"], ["export-universal"]], ids=lambda c: c[0]
)
def test_tied_copies_that_differ_are_refused_before_anything_is_written(command, ds, tmp_path):
    """The second stage's copy of the tie's first moment changed by one bit: refused by validation (CK237, naming
    the file), no output (either copy would be a guess; DeepSpeed's ds_to_universal keeps whichever it extracts
    last). (A changed master copy is also not the stage's saved weight, CK235.)"""
    source = _copy_source(ds, tmp_path)
    path = _tag(source) / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(path, weights_only=False)
    moment = state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"]
    moment.view(torch.int32)[0] ^= 1  # the tied module is the stage's first parameter
    torch.save(state, path)
    result = CliRunner().invoke(cli, [command[0], str(source), str(tmp_path / "out"), *command[1:]])
    assert result.exit_code == 1 and "CK237" in result.output and "'0.weight'" in result.output, result.output
    assert "zero_pp_rank_0_mp_rank_01_optim_states.pt" in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _copy_source(ds, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(ds.path(SOURCE), source, ignore=shutil.ignore_patterns("*.rank*.pt", "eval.pt"))
    return source


def test_a_source_stage_whose_optimizer_order_is_not_its_modules_is_refused(ds, tmp_path):
    """The second stage saved as if its optimizer listed the tied module last (its flat masters, moments, slice
    mappings and param_shapes rotated alike: a valid checkpoint, ckptspec reads it): not the order DeepSpeed's
    PipelineModule gives, so the target stages' order would be a guess. CK410 by name, nothing written."""
    source = _copy_source(ds, tmp_path)
    optim = _tag(source) / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    state = torch.load(optim, weights_only=False)
    osd = state["optimizer_state_dict"]
    mapping = osd["param_slice_mappings"][0]
    tie, used = mapping["tied_modules.emb.weight"].numel, sum(m.numel for m in mapping.values())

    def rotated(flat):
        return torch.cat([flat[tie:used], flat[:tie], flat[used:]])

    osd["single_partition_of_fp32_groups"][0] = rotated(osd["single_partition_of_fp32_groups"][0])
    moments = osd["base_optimizer_state"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        moments[key] = rotated(moments[key])
    names = [*list(mapping)[1:], "tied_modules.emb.weight"]
    address, start = type(mapping["tied_modules.emb.weight"]), 0
    osd["param_slice_mappings"][0] = type(mapping)()
    for n in names:
        osd["param_slice_mappings"][0][n] = address(numel=mapping[n].numel, start=start)
        start += mapping[n].numel
    torch.save(state, optim)
    model = _tag(source) / "mp_rank_01_model_states.pt"
    states = torch.load(model, weights_only=False)
    shapes = states["param_shapes"][0]
    states["param_shapes"][0] = type(shapes)((n, shapes[n]) for n in names)
    torch.save(states, model)
    assert CliRunner().invoke(cli, ["validate", str(source)]).exit_code == 0
    result = CliRunner().invoke(
        cli, ["reshard", str(source), str(tmp_path / "out"), "--world-size", "2", "--pipeline-parallel", "1"]
    )
    assert result.exit_code == 1 and "CK410" in result.output, result.output
    assert "optimizer order" in result.output and "not its module's parameter order" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_parameters_partition_that_a_frozen_parameter_decides_is_refused():
    """DeepSpeed's "parameters" method counts a parameter frozen after the model was built, not one its layer
    froze: where the two counts cut other stages, CK410; where they agree (and with "uniform"), the cut."""
    param = SimpleNamespace
    layers = PipelineLayers(
        tensors={0: {"f": "0.f", "w": "0.w"}, **{i: {"w": f"{i}.w"} for i in (1, 2, 3)}},
        trainable=[(0, param(name=f"{i}.w", numel=100)) for i in range(4)],
        extras={"0.f": ("frozen", 1000)},
    )
    assert _bounds(layers, 4, "parameters") == [0, 1, 2, 3, 4]  # one layer a stage either way
    assert _bounds(layers, 2, "uniform") == [0, 2, 4]
    with pytest.raises(ReshardUnsupported, match="frozen '0.f'"):
        _bounds(layers, 2, "parameters")  # [100] * 4 cuts after layer 1, [1100, 100, 100, 100] after layer 0


@pytest.mark.parametrize("name", ["pp1-s1-fp32-ws2-extras", "pp3-s1-fp32-ws3-extras"])
def test_ckptspec_describes_real_saves_at_the_target_layouts(name, ds):
    """Real DeepSpeed saves of the same model at the targets' layouts (PIPE_TARGET_SPECS): valid to ckptspec,
    every layer file on the stage whose job ran it (at 3 stages the tie-only layers 0 and 4 lie at stage boundaries:
    CK202 before), the frozen weight, the buffer and the tie (its gain and buffer too) as in the source's index."""
    entry = ds.path(name)
    assert CliRunner().invoke(cli, ["validate", str(entry)]).exit_code == 0
    index = ckptspec.open(entry).index
    ranks = json.loads((entry / "parallel.json").read_text())["ranks"]
    runs = {layer: r["pp"] for r in ranks for layer in range(*r["stage_layers"])}
    assert {f.layer: f.pipeline for f in index.layer_files} == runs
    assert {e.name: e.role for e in index.extras} == EXTRAS
    assert index.aliases == {"4.weight": "0.weight"}
