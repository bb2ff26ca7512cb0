"""Issue #17: ZeRO stage-0, native MoE and universal checkpoints generated, validated and reconstructed
through the checkpoint index, against the real checkpoints of the harness (PARALLEL) and the oracles
their jobs recorded: the live engine's fp32 masters on every rank (``oracle.rank*.pt``: every
expert from the rank that owns it) and, for universal folders, DeepSpeed's own ``fp32.pt`` tensors
(read with torch here, the oracle)."""

import json

import pytest
from _harness import scenarios
from _harness.reconstruction import invoke

STAGE0 = sorted(n for n in scenarios.PARALLEL if n.startswith(("s0-", "moe-ep2-s0-")) and not n.endswith("ws1"))
# with the two-layer and fp16 MoE sources (issue #40)
MOE_ZERO = sorted(n for n in scenarios.PARALLEL if n.startswith(("moe-ep2-s1-", "moe-ep2-s2-"))) + sorted(
    scenarios.MOE_LAYERS_SPECS
)
UNIVERSAL = ["uc-s2-bf16-ws2", "uc-s3-bf16-ws2"]
PIPELINE_S0 = ["pp2-s0-bf16-ws2"]  # BF16_Optimizer: masters partitioned like stage 1, param_shapes None
ALL = STAGE0 + MOE_ZERO + PIPELINE_S0


def _info(ds, name):
    return json.loads((ds.path(name) / "parallel.json").read_text())


def _folder(ds, name):
    info = _info(ds, name)
    return ds.path(name) / (info["universal"]["output_folder"] if name in UNIVERSAL else info["tag"])


def _live_masters(ds, name) -> dict:
    import torch

    out = {}
    for rank in range(scenarios.REGISTRY[name].world_size):
        oracle = torch.load(ds.path(name) / f"oracle.rank{rank}.pt", weights_only=True)
        for local, master in oracle["masters"].items():
            out.setdefault(oracle["params"][local]["global_name"], master.detach().float())
    return out


def _live_buffers(ds, name) -> dict:
    """The module's buffers in the job (every rank holds them; rank 0 saves the module)."""
    import torch

    return torch.load(ds.path(name) / "oracle.rank0.pt", weights_only=True).get("buffers", {})


def _expected_sources(ds, name) -> dict:
    """What each output tensor's bytes must be (``ckptspec.sources``), from what the live engine said it
    read each master from (``master_source``): the parameter itself when there was no master."""
    import torch

    out = {}
    for rank in range(scenarios.REGISTRY[name].world_size):
        oracle = torch.load(ds.path(name) / f"oracle.rank{rank}.pt", weights_only=True)
        for local, where in oracle["master_source"].items():
            fp32_weight = where == "module (fp32, no masters)"
            label = "universal_fp32" if name in UNIVERSAL else "module_fp32_weight" if fp32_weight else None
            out[oracle["params"][local]["global_name"]] = label or "optimizer_fp32_master"
    out.update({n: "buffer" for n in _live_buffers(ds, name)})
    by_origin = {}
    for n, origin in out.items():
        by_origin.setdefault(origin, []).append(n)
    return {origin: sorted(names) for origin, names in sorted(by_origin.items())}


def _fp32_pt(ds, name) -> dict:
    import torch

    folder, shapes = _folder(ds, name), _info(ds, name)["global_shapes"]
    out = {}
    for n, shape in shapes.items():
        value = torch.load(folder / "zero" / n / "fp32.pt", map_location="cpu", weights_only=False)
        out[n] = (value["param"] if isinstance(value, dict) else value).detach().reshape(shape)
    return out


def _bits_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ALL + UNIVERSAL)
def test_generate_validate_reconstruct_equal_the_live_masters(ds, name, tmp_path):
    """generate -> validate the document against the files -> reconstruct, bit for bit the masters
    the live engine held (and, for a universal folder, DeepSpeed's fp32.pt), with the module's buffers
    as the job held them, and the output says what each tensor is. The stage-0 FP16_Optimizer entries
    (``-fused``: DeepSpeed's FusedAdam) hold their masters in one flat fp32 group: an earlier ckptspec
    took their bf16/fp16 weights for the masters here (issue #37 H1)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = _folder(ds, name)
    doc = tmp_path / "index.json"
    result = invoke("generate", str(folder), "-o", str(doc))
    assert result.exit_code == 0, result.stderr
    index = json.loads(doc.read_text())
    assert index["format"] == "ckptspec.checkpoint"
    assert index["kind"] == ("universal" if name in UNIVERSAL else "zero")
    assert all("masters" in d for d in index["domains"])
    result = invoke("validate", str(doc), "--checkpoint", str(folder))
    assert result.exit_code == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    result = invoke("reconstruct", str(folder), str(out), "--quiet")
    assert result.exit_code == 0, result.stderr
    got = load_file(out / "model.safetensors")
    live, buffers = _live_masters(ds, name), _live_buffers(ds, name)
    assert sorted(got) == sorted([*live, *buffers])
    assert sorted(n for n in live if not _bits_equal(got[n], live[n])) == [], name
    assert all(got[n].dtype == b.dtype and torch.equal(got[n], b) for n, b in buffers.items()), name
    # what each tensor's bytes are, as the job's live engine read its masters (H1: never bf16 weights)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckptspec.sources"]) == _expected_sources(ds, name)
    if name in UNIVERSAL:
        fp32 = _fp32_pt(ds, name)
        assert sorted(n for n in fp32 if not _bits_equal(got[n], fp32[n])) == [], name


CONVERTED_FROM = ["pp2-s1-bf16-ws2", "pp2dp2-s1-fp32-ws4", "tp2-s1-fp32-ws2", "tp2-s3-bf16-ws2", "tp2dp2-s2-bf16-ws4"]


@pytest.mark.parametrize("name", CONVERTED_FROM)
def test_universal_folders_of_parallel_sources_are_their_fp32_pt(ds, name):
    """ds_to_universal of pipeline and AutoTP sources: the whole model, each tensor DeepSpeed's fp32.pt."""
    from ckptspec import load_state_dict

    folder = ds.path(name) / _info(ds, name)["universal"]["output_folder"]
    got = load_state_dict(folder)
    import torch

    shapes = _info(ds, name)["global_shapes"]
    assert sorted(got) == sorted(shapes)
    for n, shape in shapes.items():
        value = torch.load(folder / "zero" / n / "fp32.pt", map_location="cpu", weights_only=False)
        expected = (value["param"] if isinstance(value, dict) else value).detach().reshape(shape)
        assert _bits_equal(got[n], expected), n


@pytest.mark.parametrize(
    "name",
    [
        "s0-bf16-ws2",
        "s0-bf16-ws2-fused",
        "s0-fp16-ws2-fused",
        "moe-ep2-s0-bf16-ws4",
        "moe-ep2-s2-fp32-ws4",
        "uc-s3-bf16-ws2",
    ],
)
def test_load_state_dict_in_fp32_and_bf16(ds, name):
    import torch

    from ckptspec import load_state_dict

    live = _fp32_pt(ds, name) if name in UNIVERSAL else _live_masters(ds, name)
    buffers = {} if name in UNIVERSAL else _live_buffers(ds, name)
    fp32 = load_state_dict(_folder(ds, name))
    assert sorted(fp32) == sorted([*live, *buffers]) and all(_bits_equal(fp32[n], live[n]) for n in live)
    assert all(torch.equal(fp32[n], b) for n, b in buffers.items())
    bf16 = load_state_dict(_folder(ds, name), dtype="bf16")
    assert all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], live[n].to(torch.bfloat16)) for n in live)


def test_stage0_weights_without_fp32_masters_are_never_taken_for_masters(ds, tmp_path):
    """A stage-0 bf16 checkpoint whose model states hold no fp32 copy the optimizer kept (here
    FP16_Optimizer's removed) is refused by name (CK202), not reconstructed from its bf16 weights."""
    import shutil

    import torch

    tag = tmp_path / "global_step2"
    shutil.copytree(_folder(ds, "s0-bf16-ws2-fused"), tag)
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own copy: torch as the editor
    del state["optimizer"]["fp32_groups_flat"]
    torch.save(state, path)
    result = invoke("reconstruct", str(tag), str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    assert "CK202" in result.stderr and "'blocks.0.up.weight' is saved in bfloat16" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_index_that_locates_bf16_weights_as_masters_is_refused(ds, tmp_path):
    """What an earlier ckptspec generated for a stage-0 FP16_Optimizer checkpoint (H1): masters located
    in the module's bf16 weights. The index is refused (CK609), nothing is written."""
    folder = _folder(ds, "s0-bf16-ws2-fused")
    doc = tmp_path / "index.json"
    assert invoke("generate", str(folder), "-o", str(doc)).exit_code == 0
    index = json.loads(doc.read_text())
    assert all(loc["dtype"] == "float32" for loc in index["domains"][0]["masters"]["tensors"])
    for loc in index["domains"][0]["masters"]["tensors"]:  # as the earlier producer located them
        loc.update(key=["module", loc["param"]], dtype="bfloat16")
    doc.write_text(json.dumps(index))
    result = invoke("reconstruct", str(folder), str(tmp_path / "out"), "--manifest", str(doc))
    assert result.exit_code == 1, result.output
    assert "CK609" in result.stderr and "bfloat16" in result.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_shows_domains_masters_and_expert_files(ds):
    result = invoke("inspect", str(_folder(ds, "moe-ep2-s0-bf16-ws4")), "--format", "json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["degrees"] == {"pipeline": 1, "tensor": 1, "data": 4, "expert": 2}
    assert [(d["id"], d["size"], d["masters"]) for d in summary["domains"]] == [
        ("dense", 1, "optimizer_states"),
        ("expert:ep_size_2:ep0", 1, "optimizer_states"),
        ("expert:ep_size_2:ep1", 1, "optimizer_states"),
    ]
    # the dense masters: expp_rank_1's copy and mp_rank_00's; expert rank 0's: mp_rank_00's (18 copies at ws4)
    assert sum(d["replicas"] for d in summary["domains"]) == 18
    assert summary["expert_files"] == 4
    stage2 = json.loads(invoke("inspect", str(_folder(ds, "moe-ep2-s2-fp32-ws4")), "--format", "json").stdout)
    # partition_count [4, 2]: the dense group over 4 ranks, each expert group over its 2 expert-data ranks
    assert [(d["size"], d["zero_stage"]) for d in stage2["domains"]] == [(4, 2), (2, 2), (2, 2)]
    text = invoke("inspect", str(_folder(ds, "uc-s2-bf16-ws2")))
    assert text.exit_code == 0 and "(universal)" in text.stdout and "masters in universal" in text.stdout


def test_diff(ds):
    """The same checkpoint: nothing differs and B can resume; a stage-0 MoE against a stage-2 one: the
    stages differ (DeepSpeed cannot load one's optimizer state into the other)."""
    same = invoke(
        "diff", str(_folder(ds, "moe-ep2-s1-fp32-ws2")), str(_folder(ds, "moe-ep2-s1-fp32-ws2")), "--format", "json"
    )
    assert same.exit_code == 0 and json.loads(same.stdout)["resume"]["ok"], same.stdout + same.stderr
    other = invoke("diff", str(_folder(ds, "s0-fp32-ws2")), str(_folder(ds, "moe-ep2-s0-fp32-ws2")), "--format", "json")
    assert other.exit_code == 1, other.stdout + other.stderr


@pytest.mark.parametrize("command", ["generate", "reconstruct"])
def test_a_master_of_another_shape_is_refused_by_name(ds, tmp_path, command):
    """The optimizer's order is checked against the module's, shape by shape: swapping two
    parameters' masters in ``fp32_groups`` is CK202 naming the parameter, never a wrong pairing,
    and nothing is written."""
    import shutil

    import torch

    tag = tmp_path / "global_step2"
    shutil.copytree(_folder(ds, "s0-bf16-ws2"), tag)
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own copy: torch as the editor
    group = state["optimizer"]["fp32_groups"][0]
    group[0], group[1] = group[1], group[0]
    torch.save(state, path)
    out = tmp_path / ("index.json" if command == "generate" else "out")
    args = [command, str(tag), "-o", str(out)] if command == "generate" else [command, str(tag), str(out)]
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    assert "CK202" in result.stderr and "blocks.0.up.weight" in result.stderr
    assert not out.exists()


def test_a_swapped_layer_file_of_a_stage0_pipeline_is_named_once(ds, tmp_path):
    """Review: two CK235 checks both compared a stage-0 pipeline's layer files with their masters, so
    each swap was reported twice, the second time blaming the optimizer file. The swapped layer
    files are named, once each, and nothing else."""
    import shutil

    tag = tmp_path / "global_step2"
    shutil.copytree(_folder(ds, "pp2-s0-bf16-ws2"), tag)
    a, b = tag / "layer_02-model_states.pt", tag / "layer_03-model_states.pt"
    a.rename(tag / "swap.tmp")
    b.rename(a)
    (tag / "swap.tmp").rename(b)
    result = invoke("validate", str(tag), "--no-hash", "--format", "json")
    found = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "CK235"]
    assert result.exit_code == 1 and found
    files = [f["file"] for f in found]
    assert set(files) <= {a.name, b.name} and len(files) == len(set(files)), found
