"""Issue #40: tensor x pipeline parallelism, as real DeepSpeed writes it (scenarios.TP_PIPE_SPECS).

The job (job/tp_layers.py) is a PipelineModule over a PipeModelDataParallelTopology(pp 2, tp 2, dp 1) whose
blocks are Megatron-style column/row-parallel linears; each rank recorded its masters and module gathered
whole over its tensor group (``whole_masters``/``whole_module``), rank 0 DeepSpeed's ds_to_universal of the
tag. Read here with torch, never through ckptspec.
"""

import pytest
import torch
from _harness import scenarios
from _harness.job.tp_layers import UNIVERSAL_INFO
from _harness.parallel_oracles import bits_equal, info, rank_oracles

NAMES = sorted(scenarios.TP_PIPE_SPECS)
TP, PP = 2, 2
STAGE_LAYERS = {0: [0, 1, 2], 1: [3, 4]}  # partition "uniform" of the five layers
SPLIT = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # the blocks' (layers 2, 3); everything else whole


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _split_dim(global_name):
    layer, attr = global_name.split(".", 1)
    return SPLIT.get(attr) if int(layer) in (2, 3) else None


def _whole(oracles, key):
    """Global name -> the whole tensor every rank holding it recorded (they must agree bit for bit)."""
    out = {}
    for oracle in oracles:
        for name, value in oracle[key].items():
            if name in out:
                assert bits_equal(out[name], value), name
            out[name] = value
    return out


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_writes_a_layer_file_per_tensor_rank_and_a_zero_domain_per_stage_and_tensor_rank(ds, name):
    meta = info(ds.path(name))
    bf16 = "bf16_" if meta["spec"]["dtype"] == "bf16" else ""
    files = sorted(p.name for p in (ds.path(name) / meta["tag"]).iterdir())
    layers = [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(5) for t in range(TP)]
    models = [f"mp_rank_{m:02d}_model_states.pt" for m in range(PP * TP)]
    optim = [f"{bf16}zero_pp_rank_0_mp_rank_{m:02d}_optim_states.pt" for m in range(PP * TP)]
    assert files == sorted(layers + models + optim)
    # the model-parallel rank is pipeline-major: mp = stage * tp + tensor rank (the grid's ds_model_rank)
    coords = [(r["pp"], r["tp"], r["dp"], r["checkpoint_mp_rank"], r["mp_world_size"]) for r in meta["ranks"]]
    assert coords == [(0, 0, 0, 0, 4), (0, 1, 0, 1, 4), (1, 0, 0, 2, 4), (1, 1, 0, 3, 4)]
    assert meta["optimizer_class"] == "DeepSpeedZeroOptimizer"


@pytest.mark.parametrize("name", NAMES)
def test_the_model_states_record_the_degrees_the_stage_shapes_and_the_split_rules(ds, name):
    meta = info(ds.path(name))
    for mp in range(PP * TP):
        states = _load(ds.path(name) / meta["tag"] / f"mp_rank_{mp:02d}_model_states.pt")
        assert states["module"] is None and states["mp_world_size"] == 4 and states["dp_world_size"] == 1
        assert states["checkpoint_parallel_dimensions"] == {"pp_degree": PP, "tp_degree": TP}
        assert states["universal_checkpoint_info"] == UNIVERSAL_INFO  # the client state, as Megatron-DeepSpeed
        (shapes,) = states["param_shapes"]
        stage = mp // TP
        expected = {
            n: [d // TP if _split_dim(n) == i else d for i, d in enumerate(s)]
            for n, s in meta["global_shapes"].items()
            if int(n.split(".")[0]) in STAGE_LAYERS[stage]
        }
        assert {n: list(s) for n, s in shapes.items()} == expected


@pytest.mark.parametrize("name", NAMES)
def test_the_layer_files_hold_each_tensor_ranks_slice_of_the_gathered_module(ds, name):
    """Each layer_XX-model_YY file is tensor rank YY's slice of the module the job gathered whole (split
    tensors cut along their split dim, the others whole in both files)."""
    meta = info(ds.path(name))
    whole = _whole(rank_oracles(ds.path(name)), "whole_module")
    assert sorted(whole) == sorted(meta["global_shapes"])
    checked = 0
    for layer in range(5):
        for tp in range(TP):
            saved = _load(ds.path(name) / meta["tag"] / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt")
            for key, value in saved.items():
                full, dim = whole[f"{layer}.{key}"], _split_dim(f"{layer}.{key}")
                expected = full if dim is None else full.chunk(TP, dim)[tp]
                assert bits_equal(value, expected), (layer, tp, key)
                checked += 1
    assert checked == 2 * (2 + 4 + 4 + 2)


@pytest.mark.parametrize("name", NAMES)
def test_the_gathered_masters_are_the_module_in_the_training_dtype(ds, name):
    oracles = rank_oracles(ds.path(name))
    masters, module = _whole(oracles, "whole_masters"), _whole(oracles, "whole_module")
    assert sorted(masters) == sorted(module)
    for key, master in masters.items():
        assert master.dtype == torch.float32
        assert bits_equal(master.to(module[key].dtype), module[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_deepspeeds_universal_folder_of_the_source_holds_the_gathered_masters(ds, name):
    """DeepSpeed's own ds_to_universal merges this layout by the client state's patterns: its fp32 of every
    parameter equals the job's gathered master bit for bit."""
    meta = info(ds.path(name))
    assert meta["universal"]["ok"], meta["universal"]
    folder = ds.path(name) / meta["universal"]["output_folder"] / "zero"
    masters = _whole(rank_oracles(ds.path(name)), "whole_masters")
    assert sorted(p.name for p in folder.iterdir()) == sorted([*masters, "optimizer_state.pt"])
    for key, master in masters.items():
        fp32 = _load(folder / key / "fp32.pt")["param"]
        assert bits_equal(fp32, master), key
