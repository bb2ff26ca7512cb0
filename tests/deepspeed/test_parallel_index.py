"""Issue #16: tensor- and pipeline-parallel DeepSpeed checkpoints described by a checkpoint index,
validated and reconstructed, against the real checkpoints of the harness (PARALLEL) and the oracles
their jobs recorded: the live engine's fp32 masters on every rank (``oracle.rank*.pt``), DeepSpeed's
own ``ds_to_universal`` folder, ``zero_to_fp32`` on model-parallel rank 0, and the parallel job's
logits. Placements are checked against DeepSpeed's ``affine_map`` read with torch here, never
through ckptspec's reading of it.
"""

import json
import re
from pathlib import Path

import pytest
from _harness import scenarios
from _harness.job.parallel_models import reference_model, torch_dtype
from _harness.reconstruction import invoke
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
INDEX_SCHEMA = Draft202012Validator(json.loads((ROOT / "schema" / "checkpoint-1.0.schema.json").read_text()))
MANIFEST_SCHEMA = Draft202012Validator(json.loads((ROOT / "schema" / "manifest-1.1.schema.json").read_text()))

# Every #16 layout of the harness (the stage-0 BF16_Optimizer pipeline is #17's: see REFUSED)
MP = [
    "pp2-s1-fp32-ws2",
    "pp2-s1-bf16-ws2",
    "pp2-s0-bf16-ws2",  # BF16_Optimizer
    "pp2dp2-s1-fp32-ws4",
    "pp2dp2-s1-bf16-ws4",
    "tp2-s1-fp32-ws2",
    "tp2dp2-s2-bf16-ws4",
    "tp2-s3-bf16-ws2",
]


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args):
    """The command in-process (the machine is shared: no interpreter start-up per call)."""
    result = invoke(*args)
    return _Result(result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="session")
def _subprocess(ckptspec_process):
    def _subprocess(*args):
        return ckptspec_process(args)

    return _subprocess


def _info(ds, name):
    return json.loads((ds.path(name) / "parallel.json").read_text())


def _oracles(ds, name):
    import torch

    return [
        torch.load(ds.path(name) / f"oracle.rank{r}.pt", weights_only=True)
        for r in range(scenarios.REGISTRY[name].world_size)
    ]


def _bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(raw), b.contiguous().view(raw))


def _affine_pieces(ds, name, tp, global_name):
    """DeepSpeed's own pieces of ``global_name`` on tensor rank ``tp`` (torch.load of its model states)."""
    import torch

    info = _info(ds, name)
    prefix = "zero_pp_rank_0_" if info["spec"]["stage"] == 3 else ""
    states = torch.load(
        ds.path(name) / info["tag"] / f"{prefix}mp_rank_{tp:02d}_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    params = states["universal_checkpoint_info"]["affine_map"]["params"]
    (entry,) = [e for pattern, e in params.items() if re.match(pattern, global_name)]
    return entry["ranks"][tp]["pieces"]


def _shard_of(whole, pieces, local_shape):
    """Rank's shard cut out of the whole tensor by DeepSpeed's affine pieces."""
    import torch

    local = torch.empty(local_shape, dtype=whole.dtype)
    for p in pieces:
        dst = local.as_strided(p["shape"], p["dest"][1], p["dest"][0])
        dst.copy_(whole.as_strided(p["shape"], p["source"][1], p["source"][0]))
    return local


def _universal(ds, name, global_name, shape):
    import torch

    folder = ds.path(name) / _info(ds, name)["universal"]["output_folder"]
    value = torch.load(folder / "zero" / global_name / "fp32.pt", map_location="cpu", weights_only=True)
    value = value["param"] if isinstance(value, dict) else value
    return value.view(shape)


@pytest.fixture(scope="module")
def reconstructed(ds, tmp_path_factory):
    """name -> the whole model ``ckptspec reconstruct`` wrote (fp32), read back with safetensors."""
    from safetensors.torch import load_file

    cache = {}

    def get(name, dtype="fp32"):
        if (name, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"{name}-{dtype}")
            result = _cli("reconstruct", str(ds.path(name)), str(out), "--dtype", dtype, "--quiet")
            assert result.returncode == 0, result.stderr
            cache[(name, dtype)] = load_file(out / "model.safetensors")
        return cache[(name, dtype)]

    return get


# --------------------------------------------------------------------------------------------
# generate and validate


@pytest.mark.parametrize("name", MP)
def test_generate_describes_the_layout(ds, name, tmp_path):
    info = _info(ds, name)
    spec, ws = info["spec"], info["world_size"]
    out = tmp_path / "index.json"
    result = _cli("generate", str(ds.path(name)), "-o", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert sorted(e.message for e in INDEX_SCHEMA.iter_errors(doc)) == []
    for domain in doc["domains"]:  # each domain is a 1.x manifest any 1.x reader can check
        assert sorted(e.message for e in MANIFEST_SCHEMA.iter_errors(domain["manifest"])) == []
    dp = ws // (spec["pp"] * spec["tp"])
    assert doc["topology"]["degrees"] == {"pipeline": spec["pp"], "tensor": spec["tp"], "data": dp}
    assert doc["topology"]["degrees_source"] == "checkpoint_parallel_dimensions"
    # one domain per model-parallel rank, at DeepSpeed's coordinate, over the data-parallel group
    coords = sorted((r["pp"], r["tp"], r["checkpoint_mp_rank"]) for r in info["ranks"])
    assert sorted((d["coordinate"]["pipeline"], d["coordinate"]["tensor"]) for d in doc["domains"]) == sorted(
        {(p, t) for p, t, _ in coords}
    )
    for d in doc["domains"]:
        mp = next(m for p, t, m in coords if (p, t) == (d["coordinate"]["pipeline"], d["coordinate"]["tensor"]))
        assert d["size"] == dp and all(f"mp_rank_{mp:02d}_" in path for path in d["file_ranks"])
    # the whole model, as the tp1/pp1 reference model names and shapes it
    assert {p["name"]: p["shape"] for p in doc["parameters"]} == info["global_shapes"]
    if spec["pp"] > 1:
        assert [lf["path"] for lf in doc["layer_files"]] == [f"layer_0{i}-model_states.pt" for i in range(5)]
        assert doc["layer_files"][1]["tensors"] == {}
        layers = {r["pp"]: r["stage_layers"] for r in info["ranks"]}  # [start, stop) per stage, from the engine
        for lf in doc["layer_files"]:
            start, stop = layers[lf["pipeline"]]
            assert start <= lf["layer"] < stop, lf
    assert _cli("validate", str(out)).returncode == 0
    result = _cli("validate", str(ds.path(name)), "--format", "json")
    assert result.returncode == 0 and json.loads(result.stdout)["findings"] == [], result.stdout
    result = _cli("validate", str(out), "--checkpoint", str(ds.path(name)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_autotp_placements_follow_deepspeeds_affine_map(ds, tmp_path):
    """Column-parallel up.* split along axis 0, row-parallel down.weight along axis 1, the rest replicated:
    the index's placements cut each rank's shard out of the universal tensor exactly as DeepSpeed's pieces."""
    import torch

    name = "tp2dp2-s2-bf16-ws4"
    out = tmp_path / "index.json"
    assert _cli("generate", str(ds.path(name)), "-o", str(out)).returncode == 0
    doc = json.loads(out.read_text())
    kinds = {}
    for p in doc["parameters"]:
        whole = _universal(ds, name, p["name"], p["shape"])
        for tp, shard in enumerate(p["shards"]):
            placement = shard["placement"]
            if placement == "replicated":
                mine = whole
                kinds[p["name"]] = "replicated"
            else:
                split = placement["split"]
                mine = whole.narrow(split["axis"], split["offset"], split["length"])
                kinds[p["name"]] = f"axis {split['axis']}"
            theirs = _shard_of(whole, _affine_pieces(ds, name, tp, p["name"]), shard["local_shape"])
            assert torch.equal(mine, theirs), (p["name"], tp)
    assert kinds == {
        **{f"blocks.{b}.up.{w}": "axis 0" for b in (0, 1) for w in ("weight", "bias")},
        **{f"blocks.{b}.down.weight": "axis 1" for b in (0, 1)},
        **{f"blocks.{b}.down.bias": "replicated" for b in (0, 1)},
        "head.weight": "replicated",
        "head.bias": "replicated",
    }


# --------------------------------------------------------------------------------------------
# reconstruct: bit for bit against the live masters and DeepSpeed's universal folder


@pytest.mark.parametrize("name", MP)
def test_reconstruction_is_the_live_masters(ds, name, reconstructed):
    """Every rank's gathered master (safe_get_full_fp32_param, in the job) is, bit for bit, its shard of
    the reconstructed whole (cut by DeepSpeed's affine pieces under tensor parallelism)."""
    whole = reconstructed(name)
    spec = _info(ds, name)["spec"]
    checked = 0
    for oracle in _oracles(ds, name):
        tp = oracle["coords"]["tp"]
        for local, master in oracle["masters"].items():
            g = oracle["params"][local]["global_name"]
            mine = whole[g] if spec["tp"] == 1 else _shard_of(whole[g], _affine_pieces(ds, name, tp, g), master.shape)
            assert _bits_equal(mine, master), (name, oracle["coords"], local)
            checked += 1
    assert checked >= len(whole)


CONVERTIBLE = [n for n in MP if n != "pp2-s0-bf16-ws2"]  # DeepSpeed refuses it: test_parallel_harness


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_reconstruction_is_deepspeeds_universal_fp32(ds, name, reconstructed):
    whole = reconstructed(name)
    assert sorted(whole) == sorted(_info(ds, name)["global_shapes"])
    for g, tensor in whole.items():
        assert _bits_equal(tensor, _universal(ds, name, g, tensor.shape)), (name, g)


@pytest.mark.parametrize("name", ["tp2-s1-fp32-ws2", "tp2dp2-s2-bf16-ws4", "pp2dp2-s1-fp32-ws4"])
def test_load_state_dict_and_low_precision_output(ds, name, reconstructed):
    """load_state_dict gives the same tensors; --dtype bf16 is the fp32 whole rounded as torch rounds."""
    import torch

    import ckptspec

    whole = reconstructed(name)
    loaded = ckptspec.load_state_dict(ds.path(name))
    assert list(loaded) == list(whole) and all(_bits_equal(loaded[n], whole[n]) for n in whole)
    low = reconstructed(name, "bf16")
    assert all(_bits_equal(low[n], whole[n].to(torch.bfloat16)) for n in whole)


@pytest.mark.parametrize("name", ["tp2-s1-fp32-ws2", "tp2dp2-s2-bf16-ws4", "tp2-s3-bf16-ws2"])
def test_zero_to_fp32_of_mp_rank_0_is_tensor_rank_0s_shard(zero_to_fp32, ds, name, reconstructed, tmp_path):
    """DeepSpeed's zero_to_fp32 reads mp_rank_00's files only: what it returns is tensor rank 0's shard of
    each reconstructed parameter (DeepSpeed's pieces), bit for bit."""
    tag = _info(ds, name)["tag"]
    (tmp_path / tag).mkdir()
    (tmp_path / "latest").write_text(tag)
    for path in (ds.path(name) / tag).iterdir():
        if "mp_rank_00" in path.name:
            (tmp_path / tag / path.name).symlink_to(path)
    state = zero_to_fp32(tmp_path)
    whole = reconstructed(name)
    assert sorted(state) == sorted(whole)
    for g, t in state.items():
        assert _bits_equal(_shard_of(whole[g], _affine_pieces(ds, name, 0, g), t.shape), t.float()), g


def _logit_tolerance(spec):
    """As tests/deepspeed/test_parallel_harness.py: the whole model sums a row-parallel layer's two
    halves in another order (1.2e-7 fp32, 2**-7 bf16 measured); pipelines are bit for bit."""
    if spec["tp"] > 1:
        return 1e-6 if spec["dtype"] == "fp32" else 2**-6
    return 0.0


@pytest.mark.parametrize("name", MP)
def test_the_reconstructed_model_gives_the_parallel_jobs_logits(ds, name, reconstructed):
    import torch

    spec = _info(ds, name)["spec"]
    dt = torch_dtype(spec)
    model = reference_model(spec).to(dt)
    model.load_state_dict({n: t.to(dt) for n, t in reconstructed(name).items()}, strict=True)
    model.eval()
    inputs = torch.load(ds.path(name) / "eval.pt", weights_only=True)["inputs"]
    with torch.no_grad():
        out = model(inputs.to(dt))
    recorded = [o["logits"] for o in _oracles(ds, name) if o["logits"] is not None]
    assert recorded
    for logits in recorded:
        if _logit_tolerance(spec) == 0.0:
            assert _bits_equal(logits, out), name
        else:
            assert (logits.float() - out.float()).abs().max().item() <= _logit_tolerance(spec), name


# --------------------------------------------------------------------------------------------
# inspect and diff


def test_inspect_shows_the_parallel_layout(ds):
    result = _cli("inspect", str(ds.path("pp2dp2-s1-fp32-ws4")), "--format", "json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["degrees"] == {"pipeline": 2, "tensor": 1, "data": 2}
    assert [(d["id"], d["size"], d["zero_stage"]) for d in summary["domains"]] == [("pp0-tp0", 2, 1), ("pp1-tp0", 2, 1)]
    assert summary["layer_files"] == 5 and summary["placements"] == {"whole": 12}
    text = _cli("inspect", str(ds.path("tp2-s1-fp32-ws2")))
    assert text.returncode == 0 and "pipeline 1 x tensor 2 x data 1" in text.stdout, text.stdout + text.stderr


def test_diff_says_a_change_of_parallel_degrees_cannot_resume(ds):
    """A job at another tensor/pipeline degree cannot load ZeRO partitions saved at these (CK508)."""
    result = _cli("diff", str(ds.path("tp2-s1-fp32-ws2")), str(ds.path("pp2-s1-fp32-ws2")), "--format", "json")
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert [r["code"] for r in doc["resume"]["reasons"]] == ["CK508"]
    same = _cli("diff", str(ds.path("pp2-s1-fp32-ws2")), str(ds.path("pp2-s1-fp32-ws2")), "--format", "json")
    assert same.returncode == 0 and json.loads(same.stdout)["resume"]["ok"], same.stdout + same.stderr


# --------------------------------------------------------------------------------------------
# what is still refused, by name


# Every pipeline/AutoTP layout of the harness is described; the stage-0 BF16_Optimizer pipeline by #17
# (tests/deepspeed/test_masters_index.py). Its masters' shapes come from the layer files only:


def test_a_stage0_pipeline_without_a_layer_file_is_refused_naming_it(_subprocess, ds, tmp_path):
    import shutil

    save = tmp_path / "ckpt"
    shutil.copytree(ds.path("pp2-s0-bf16-ws2"), save, symlinks=True)
    (save / "global_step2" / "layer_03-model_states.pt").unlink()
    result = _subprocess("generate", str(save))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "CK230" in result.stderr and "layer_03-model_states.pt" in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------
# DeepSpeed < 0.19.5: no checkpoint_parallel_dimensions


def _without(ds, name, tmp_path, *keys):
    """A copy of the checkpoint whose model-states files lack ``keys`` (as older DeepSpeed wrote them)."""
    import shutil

    import torch

    save = tmp_path / "ckpt"
    shutil.copytree(ds.path(name), save, symlinks=True)
    for path in (save / _info(ds, name)["tag"]).glob("*model_states.pt"):
        if path.name.startswith("layer_"):
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)
        for key in keys:
            state.pop(key, None)
        torch.save(state, path)
    return save


@pytest.mark.parametrize("name", ["tp2dp2-s2-bf16-ws4", "pp2dp2-s1-fp32-ws4"])
def test_degrees_are_derived_without_checkpoint_parallel_dimensions(ds, name, tmp_path, reconstructed):
    """From mp_world_size and the names (a pipeline writes layer files and no module, AutoTP a module
    and no layer files), recorded as derived; the reconstruction is the same."""
    import ckptspec

    save = _without(ds, name, tmp_path, "checkpoint_parallel_dimensions")
    out = tmp_path / "index.json"
    assert _cli("generate", str(save), "-o", str(out)).returncode == 0
    topology = json.loads(out.read_text())["topology"]
    spec = _info(ds, name)["spec"]
    assert topology["degrees_source"] == "derived"
    assert (topology["degrees"]["pipeline"], topology["degrees"]["tensor"]) == (spec["pp"], spec["tp"])
    whole = reconstructed(name)
    loaded = ckptspec.load_state_dict(save)
    assert list(loaded) == list(whole) and all(_bits_equal(loaded[n], whole[n]) for n in whole)


def test_degrees_are_never_assumed(ds, tmp_path):
    """Neither checkpoint_parallel_dimensions nor mp_world_size: refused, never read as degree 1."""
    save = _without(ds, "tp2-s1-fp32-ws2", tmp_path, "checkpoint_parallel_dimensions", "mp_world_size")
    result = _cli("generate", str(save))
    assert result.returncode == 1 and "CK202" in result.stderr and "never assumed" in result.stderr, result.stderr
