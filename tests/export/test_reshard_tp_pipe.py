"""Issue #40: a tensor x pipeline-parallel checkpoint (tp2 x pp2, Megatron-style layers: scenarios.TP_PIPE_SPECS)
merged to tensor degree 1 at the same stages (``reshard --tensor-parallel 1``) and exported as a universal folder,
each loaded by a real job of the plain PipelineModule (scenarios.TP_PIPE_RESHARDS, tests/_harness/optim_job.py).

Ground truth: what the source job gathered whole over its tensor groups from the live engine (masters, Adam
moments, module weights: job/tp_layers.py) and its logits. The same target job also loaded DeepSpeed's own
path, ``ds_to_universal`` of the source with ``load_universal`` (recorded beside as ``universal.rank<R>.pt``).
"""

import os

import numpy as np
import pytest
import torch
from _harness import scenarios
from _harness.parallel_oracles import bits_equal, gathered_whole, info, logits_of, optim_records, rank_oracles
from _harness.reconstruction import invoke

CASES = sorted(scenarios.TP_PIPE_RESHARDS)
MERGES = [n for n in CASES if "tensor_parallel" in scenarios.TP_PIPE_RESHARDS[n][3]]
# the logits of the fixed batch after loading, as a share of the largest logit: the merged blocks compute each output
# in one matmul where the source summed two tensor ranks' partials (measured 1.5e-7 in fp32, 4.7e-3 in bf16: one
# bf16 step at 0.41)
LOGITS_SHARE = {"fp32": 1e-6, "bf16": 0.01}


def _source(name):
    return scenarios.TP_PIPE_RESHARDS[name][0]


def _check_loaded(records, whole):
    held = set()
    for r in records:
        for name, master in r["master"].items():
            held.add(name)
            assert bits_equal(master, whole["master"][name]), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert bits_equal(r["state"][name][key], whole[key][name]), (name, key)
            assert r["step"][name] == 2.0, (name, r["step"][name])  # the source trained two steps
            assert r["source"][name] == "safe_get_full_optimizer_state"
    assert sorted(held) == sorted(whole["master"])


@pytest.mark.parametrize("name", CASES)
def test_the_target_job_holds_the_sources_whole_masters_moments_and_step(ds, name):
    import json

    outcome = json.loads((ds.path(name) / "optim.json").read_text())
    assert "reshard_error" not in outcome and outcome["load_checkpoint_error"] is None, outcome
    records = optim_records(ds.path(name))
    assert [(r["coords"]["pp"], r["coords"]["tp"]) for r in records] == [
        (rank * 2 // len(records), 0) for rank in range(len(records))
    ]
    whole = gathered_whole(ds.path(_source(name)))
    _check_loaded(records, whole)
    dtype = info(ds.path(_source(name)))["spec"]["dtype"]
    source_logits = logits_of(rank_oracles(ds.path(_source(name))))
    off = np.abs(logits_of(records).float().numpy() - source_logits.float().numpy()).max()
    assert off <= LOGITS_SHARE[dtype] * np.abs(source_logits.float().numpy()).max(), off


@pytest.mark.parametrize("name", CASES)
def test_deepspeeds_universal_path_gives_the_same(ds, name):
    """ds_to_universal's folder of the same source, loaded by the same target with load_universal: the same masters,
    moments and step (DeepSpeed merges this layout by the client state's patterns)."""
    import json

    assert json.loads((ds.path(name) / "optim.json").read_text())["universal_error"] is None
    _check_loaded(optim_records(ds.path(name), "universal"), gathered_whole(ds.path(_source(name))))


@pytest.mark.parametrize("name", MERGES)
def test_the_merged_layer_files_and_model_states_are_a_tp1_pipelines(ds, name):
    tag = ds.path(name) / "resharded" / "global_step2"
    whole = gathered_whole(ds.path(_source(name)))["module"]
    files = sorted(os.listdir(tag))
    assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    for layer in range(5):
        saved = torch.load(tag / f"layer_{layer:02d}-model_states.pt", weights_only=True)
        assert sorted(saved) == sorted(k.split(".", 1)[1] for k in whole if k.split(".")[0] == str(layer))
        for key, value in saved.items():
            assert bits_equal(value, whole[f"{layer}.{key}"]), (layer, key)
    for stage in range(2):
        states = torch.load(tag / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)
        assert states["mp_world_size"] == 2 and states["checkpoint_parallel_dimensions"] == {
            "pp_degree": 2,
            "tp_degree": 1,
        }
        assert states["module"] is None and "universal_checkpoint_info" in states  # the client state, as saved


def test_ckptspecs_universal_folder_is_ds_to_universals_file_for_file(ds):
    """export-universal of the source against DeepSpeed's ds_to_universal of it: the same files, each holding the
    same (``cat_dim`` 1 for the row-parallel weights, none for the replicated tensors, each stage's step, the same
    optimizer state; the model states byte for byte)."""
    name = "tp2pp2-s1-fp32-ws4>universal-tp1"
    ours = ds.path(name) / "resharded" / "universal"
    theirs = ds.path(_source(name)) / info(ds.path(_source(name)))["universal"]["output_folder"]
    compared, only_theirs = 0, []
    for folder, _, names in os.walk(theirs):
        for file in names:
            path = os.path.join(folder, file)
            mine = ours / os.path.relpath(path, theirs)
            if not mine.exists():
                only_theirs.append(path)
                continue
            if file.startswith("mp_rank_"):
                assert mine.read_bytes() == open(path, "rb").read(), path
            else:
                a, b = torch.load(path, weights_only=False), torch.load(mine, weights_only=False)
                if torch.is_tensor(a):  # step.pt: the step itself
                    assert bits_equal(a, b), path
                    compared += 1
                    continue
                assert sorted(a) == sorted(b), (path, sorted(a), sorted(b))
                for key in a:
                    same = bits_equal(a[key], b[key]) if torch.is_tensor(a[key]) else repr(a[key]) == repr(b[key])
                    assert same, (path, key)
            compared += 1
    assert not only_theirs and compared == 4 + 1 + 12 * 4
    assert sum(len(files) for _, _, files in os.walk(ours)) == compared


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--stage", "2"], "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
        (["--world-size", "3"], "--world-size 3 is not a multiple of the pipeline degree 2"),
    ],
)
def test_what_the_merge_does_not_write_is_refused_by_name_before_writing(ds, tmp_path, options, message):
    world = [] if "--world-size" in options else ["--world-size", "2"]
    result = invoke(
        "reshard",
        ds.path(scenarios.TP_PIPE_RESHARDS[MERGES[0]][0]),
        tmp_path / "out",
        "--tensor-parallel",
        "1",
        *world,
        *options,
    )
    assert result.exit_code != 0 and "CK410" in result.output and message in result.output, result.output
    assert not (tmp_path / "out").exists()
