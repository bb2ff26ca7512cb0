"""#40: MoE checkpoints of two MoE layers and of fp16 (dynamic loss scale), resharded (``MOE_LAYERS_SPECS``).

The moves themselves (masters, moments, step, param groups and logits after a real DeepSpeed job loaded the output)
are checked with the other MoE moves: test_reshard_moe.py (ZeRO-1/2 targets), test_reshard_moe_to_stage0.py (a stage-0
target) and test_universal_parallel.py (the universal folder, beside ``ds_to_universal``'s crash); generate, validate
and reconstruct of the sources in deepspeed/test_masters_index.py. Here: what those do not look at. DeepSpeed numbers
MoE layers in module order and names each expert file by layer and global expert (``layer_1_expert_0_...``); the
written files are compared with DeepSpeed's own save of the same model at the target layout (the ep1 and ep2
sources are each other's). An fp16 ZeRO job's loss scaler (its scale and counters) moves with the checkpoint, and the
target job's scale is the source job's.
"""

from __future__ import annotations

import re

import pytest
import torch
from _harness.parallel_oracles import info, optim_records, saved_entries
from _harness.scenarios import (
    DEGREE_RESHARDS,
    MOE_LAYERS_SPECS,
    RESHARD_SOURCES,
    SOURCE_SPECS,
    optim_name,
    reshard_target,
    source_spec,
)

_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
# The target's layout saved by DeepSpeed itself: the same model, expert degree, experts, world size and dtype.
NATIVE = {
    "moe2-ep2-s2-bf16-ws2>ep1-s1": "moe2-ep1-s2-bf16-ws2",
    "moe2-ep2-s2-bf16-ws2>ep1": "moe2-ep1-s2-bf16-ws2",
    "moe2-ep1-s2-bf16-ws2>ep2": "moe2-ep2-s2-bf16-ws2",
    "moe2-ep1-s2-bf16-ws2>ep2-s1": "moe2-ep2-s2-bf16-ws2",
    "moe2-ep2-s2-bf16-ws4>ws2": "moe2-ep2-s2-bf16-ws2-x4",
}
FP16 = sorted(n for n, (source, *_) in DEGREE_RESHARDS.items() if source in MOE_LAYERS_SPECS and "fp16" in source)
# what a stage-0 wrapper (FP16_UnfusedOptimizer's loss_scale_config) saves and loads of the scaler: no hysteresis
STAGE0_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _tag_dir(root):
    return root / (root / "latest").read_text().strip()


@pytest.mark.parametrize("source", sorted(MOE_LAYERS_SPECS))
def test_deepspeed_names_the_second_moe_layers_expert_files_by_its_layer_index(source, ds):
    """The sources hold what the moves must keep: an expert file per MoE layer and global expert, layer 1's holding
    ``moe2``'s expert under its global index."""
    spec = source_spec(source)
    tag = _tag_dir(ds.path(source))
    files = {tuple(map(int, m.groups())): p for p in tag.iterdir() if (m := _EXPERT_FILE.fullmatch(p.name))}
    assert sorted(files) == [(layer, e) for layer in (0, 1) for e in range(spec["experts"])]
    for (layer, e), path in files.items():
        prefix = f"{'moe' if layer == 0 else 'moe2'}.deepspeed_moe.experts.deepspeed_experts.{e}."
        assert list(_load(path)) == [f"{prefix}{i}.{w}" for i in (0, 2) for w in ("weight", "bias")], path.name


@pytest.mark.parametrize("source", sorted(set(MOE_LAYERS_SPECS) & set(RESHARD_SOURCES)))
def test_every_expert_of_both_layers_trained(source, ds):
    """A MoE layer's experts are built as copies of one module: an expert its gate never sent a token would hold the
    same values as its neighbours, and a move that swapped them would go unseen. Every expert of both layers has
    moments (the source job's, after loading it)."""
    records = optim_records(ds.path(optim_name(source)))
    moments = {n: s["exp_avg"] for r in records for n, s in r["state"].items() if "deepspeed_experts" in n}
    experts = {(n.split(".")[0], int(n.split("deepspeed_experts.")[1].split(".")[0])) for n in moments}
    assert experts == {(m, e) for m in ("moe", "moe2") for e in range(source_spec(source)["experts"])}
    for layer, e in sorted(experts):
        mine = [v for n, v in moments.items() if n.startswith(f"{layer}.") and f"deepspeed_experts.{e}." in n]
        assert any(v.abs().max() > 0 for v in mine), (layer, e)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_the_files_are_deepspeeds_own_save_at_the_target_layout(name, ds):
    """The same file names (both layers' expert files), and in each the same entries: names (the optimizer files'
    ``param_slice_mappings`` and the model states' ``param_shapes`` under the target's local expert names, both
    layers), tensor dtypes and shapes, the loss scaler and every other value but a changed ZeRO stage and, from
    another world size, ``global_samples`` (the samples the source saw). DeepSpeed's
    run is another training run, so tensor values are not compared here (test_reshard_moe.py compares what a job
    loads). One order differs: within a group's Adam state, ckptspec's ZeRO writers put the moments before
    ``step`` (torch's Adam creates ``step`` first); a dict, read by key."""
    source, world_size, spec = reshard_target(name)
    native_spec = source_spec(NATIVE[name])
    assert SOURCE_SPECS[NATIVE[name]][1] == world_size
    assert {k: native_spec[k] for k in ("ep", "experts", "moe_layers", "dtype")} == {
        k: spec[k] for k in ("ep", "experts", "moe_layers", "dtype")
    }
    ours, theirs = _tag_dir(ds.path(name) / "resharded"), _tag_dir(ds.path(NATIVE[name]))
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == files and "layer_1_expert_1_mp_rank_00_model_states.pt" in files
    allowed = set()
    if spec["stage"] != native_spec["stage"]:
        allowed |= {"/ds_config/zero_optimization/stage", "/optimizer_state_dict/zero_stage"}
    if SOURCE_SPECS[source][1] != world_size:  # the source's training history: the samples it saw at its world size
        allowed.add("/global_samples")
    for file in files:
        mine, native = dict(saved_entries(_load(ours / file))), dict(saved_entries(_load(theirs / file)))
        assert sorted(mine) == sorted(native), file
        in_state = "/base_optimizer_state/state/"
        assert [k for k in mine if in_state not in k] == [k for k in native if in_state not in k], file
        differ = {k for k in mine if mine[k] != native[k]}
        assert differ <= allowed, (file, {k: (mine[k], native[k]) for k in differ})


@pytest.mark.parametrize("name", FP16)
def test_the_fp16_loss_scaler_moves_with_the_checkpoint(name, ds):
    """The target job holds the source job's dynamic loss scaler: its scale (32, doubled at each of the source's two
    steps from the initial 16 a new job starts with) and counters (``cur_iter`` 2, ``last_overflow_iter``,
    ``cur_hysteresis``...), on every rank; after one more step on the same batch, the never-stopped job's (64). A
    stage-0 target (FP16_UnfusedOptimizer) keeps what its wrapper saves: the scale, the iteration counters, the factor
    and window (it has no hysteresis)."""
    source, _, spec = reshard_target(name)
    for prefix in ("optim", "step"):
        target, before = optim_records(ds.path(name), prefix), optim_records(ds.path(optim_name(source)), prefix)
        (expected,) = {repr(r["loss_scaler"]): r["loss_scaler"] for r in before}.values()
        assert expected["dynamic"] is True and expected["cur_scale"] == {"optim": 32.0, "step": 64.0}[prefix]
        assert expected["cur_iter"] == {"optim": 2, "step": 3}[prefix]
        for record in target:
            held = record["loss_scaler"]
            if spec["stage"]:
                assert held == expected, (prefix, held)
            else:
                assert held["dynamic_loss_scale"] is True, held
                assert {k: held[k] for k in STAGE0_SCALER} == {k: expected[k] for k in STAGE0_SCALER}, (prefix, held)


def test_ds_to_universal_crashes_on_the_two_layer_moe_where_ckptspecs_folder_loads(ds):
    """Side by side: DeepSpeed's converter, run by the source job on its own tag, fails (the same error as on the
    one-layer ZeRO-2 bf16 MoE at 4 ranks); a job of the source's layout loads ckptspec's folder of it and holds its
    state bit for bit (test_universal_parallel.py, ``moe2-ep2-s2-bf16-ws2>universal``)."""
    outcome = info(ds.path("moe2-ep2-s2-bf16-ws2"))["universal"]
    assert outcome["ok"] is False and outcome["inject_missing_state"] is True, outcome
    assert outcome["error"] == "RuntimeError: shape '[32, 16]' is invalid for input of size 1024", outcome
    folder = ds.path("moe2-ep2-s2-bf16-ws2>universal") / "resharded" / "universal" / "zero"
    assert (folder / "moe2.deepspeed_moe.experts.deepspeed_experts.0.0.weight" / "fp32.pt").is_file()
