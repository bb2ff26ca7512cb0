"""Issue #40: a tensor x pipeline-parallel checkpoint (scenarios.TP_PIPE_SPECS: Megatron-style column/row-parallel
layers in a PipelineModule, tp2 x pp2) described, validated and reconstructed by ckptspec, against what the job
gathered whole over its tensor groups from the live engine (masters and Adam moments).

The split rules are the ``universal_checkpoint_info`` pattern lists the job saved in its client state, as
Megatron-DeepSpeed does; the expected placements here are the job's own (tests/_harness/job/tp_layers.py), never
ckptspec's reading of the patterns.
"""

import json
import shutil

import pytest
import torch
from _harness import scenarios
from _harness.parallel_oracles import bits_equal, info, rank_oracles
from _harness.reconstruction import invoke
from safetensors.torch import load_file

NAMES = sorted(scenarios.TP_PIPE_SPECS)
TP = 2
SPLIT = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # the blocks' (layers 2 and 3); every other tensor whole


def _whole(oracles, key, sub=None):
    out = {}
    for oracle in oracles:
        values = oracle[key] if sub is None else oracle[key][sub]
        for name, value in values.items():
            assert name not in out or bits_equal(out[name], value), name
            out[name] = value
    return out


def _split_dim(name):
    layer, attr = name.split(".", 1)
    return SPLIT.get(attr) if layer in ("2", "3") else None


@pytest.mark.parametrize("name", NAMES)
def test_the_index_places_each_tensor_ranks_shard_by_the_saved_rules(ds, name, tmp_path):
    result = invoke("validate", ds.path(name))
    assert result.exit_code == 0 and result.stdout.strip().endswith("valid"), result.stdout
    result = invoke("inspect", ds.path(name))
    assert "pipeline 2 x tensor 2 x data 1 (checkpoint_parallel_dimensions)" in result.stdout
    assert "12 parameters (2501 elements; 6 replicated, 6 split), 10 layer files" in result.stdout
    assert invoke("generate", ds.path(name), "-o", tmp_path / "index.json").exit_code == 0
    doc = json.loads((tmp_path / "index.json").read_text())
    assert doc["topology"]["degrees"] == {"pipeline": 2, "tensor": 2, "data": 1}
    shapes = info(ds.path(name))["global_shapes"]
    for param in doc["parameters"]:
        assert param["placement_source"] == "universal_checkpoint_info" and param["shape"] == shapes[param["name"]]
        dim = _split_dim(param["name"])
        layer = int(param["name"].split(".")[0])
        for tp, shard in enumerate(param["shards"]):
            assert shard["domain"] == f"pp{0 if layer < 3 else 1}-tp{tp}"
            assert shard["layer_file"] == f"layer_{layer:02d}-model_{tp:02d}-model_states.pt"
            if dim is None:
                assert shard["placement"] == "replicated" and shard["primary"] == (tp == 0)
            else:
                length = shapes[param["name"]][dim] // TP
                assert shard["placement"] == {"split": {"axis": dim, "offset": tp * length, "length": length}}
    assert [(f["layer"], f["tensor"], f["pipeline"]) for f in doc["layer_files"]] == [
        (layer, tp, 0 if layer < 3 else 1) for layer in range(5) for tp in range(TP)
    ]
    assert invoke("validate", tmp_path / "index.json", "--checkpoint", ds.path(name)).exit_code == 0


@pytest.mark.parametrize("name", NAMES)
def test_reconstruct_gives_the_gathered_masters_and_moments_bit_for_bit(ds, name, tmp_path):
    result = invoke("reconstruct", ds.path(name), tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 0, result.output
    oracles = rank_oracles(ds.path(name))
    masters = _whole(oracles, "whole_masters")
    model = load_file(tmp_path / "out" / "model.safetensors")
    optimizer = load_file(tmp_path / "out" / "optimizer.safetensors")
    assert sorted(model) == sorted(masters) == sorted(info(ds.path(name))["global_shapes"])
    for key, master in masters.items():
        assert bits_equal(model[key], master), key
    for moment in ("exp_avg", "exp_avg_sq"):
        for key, value in _whole(oracles, "whole_moments", moment).items():
            assert bits_equal(optimizer[f"{key}.{moment}"], value), (key, moment)


def _copy(ds, name, tmp_path):
    src = ds.path(name) / info(ds.path(name))["tag"]
    shutil.copytree(src, tmp_path / "ckpt" / src.name)
    (tmp_path / "ckpt" / "latest").write_text(src.name)
    return tmp_path / "ckpt" / src.name


def test_a_layer_file_one_tensor_rank_lacks_is_missing_by_name(ds, tmp_path):
    tag = _copy(ds, NAMES[0], tmp_path)
    (tag / "layer_03-model_01-model_states.pt").unlink()
    result = invoke("validate", tmp_path / "ckpt")
    assert result.exit_code == 1
    assert "layer_03-model_01-model_states.pt: $.layer_files: CK230 pipeline layer file of 3.up.weight" in result.stdout


def test_a_tensor_ranks_layer_file_of_another_save_is_caught(ds, tmp_path):
    tag = _copy(ds, NAMES[0], tmp_path)
    path = tag / "layer_00-model_01-model_states.pt"
    saved = torch.load(path, weights_only=True)
    saved["weight"][0, 0] += 1
    torch.save(saved, path)
    result = invoke("validate", tmp_path / "ckpt")
    assert result.exit_code == 1 and "CK235 0.weight" in result.stdout, result.stdout


def _edit_rules(tag, edit):
    for mp in range(4):
        path = tag / f"mp_rank_{mp:02d}_model_states.pt"
        states = torch.load(path, weights_only=False)
        edit(states)
        torch.save(states, path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("universal_checkpoint_info"), "no universal_checkpoint_info"),
        (
            lambda s: s["universal_checkpoint_info"].update(vocabulary_parameter_patterns=[r"^0\.weight$"]),
            "'0.weight' matches a universal_checkpoint_info pattern an even split cannot merge (its vocabulary",
        ),
        (
            lambda s: s["universal_checkpoint_info"].update(parameter_to_average_patterns=[r"^\d+\.up\.bias$"]),
            "'2.up.bias' matches a universal_checkpoint_info pattern an even split cannot merge (it is averaged",
        ),
    ],
)
def test_a_merge_rule_an_even_split_cannot_express_is_refused_by_name(ds, tmp_path, edit, message):
    _edit_rules(_copy(ds, NAMES[0], tmp_path), edit)
    result = invoke("reconstruct", tmp_path / "ckpt", tmp_path / "out")
    assert result.exit_code != 0 and "CK202" in result.output and message in result.output, result.output
    assert not (tmp_path / "out").exists()
