"""The ground truth of issues #16 and #17: pipeline, AutoTP, MoE, ZeRO stage 0 and universal
checkpoints built by real DeepSpeed (tests/_harness/scenarios.py PARALLEL), and the oracles their
jobs record (tests/_harness/job/parallel.py).

These tests check the oracles against DeepSpeed itself, not ckptspec: the masters gathered in the
live engine against ``zero_to_fp32`` where DeepSpeed supports the layout, against the
``ds_to_universal`` folder (placed by DeepSpeed's own ``affine_map`` under tensor parallelism),
against the module weights and the parallel job's logits; and they pin what ``ckptspec generate``
says today (CK202) until #16/#17 describe these checkpoints.
"""

import json
import re
import subprocess
import sys

import pytest
from _harness import scenarios
from _harness.job.parallel_models import normalize, reference_model, torch_dtype
from _harness.oracles import DEEPSPEED_VERSION

PARALLEL = scenarios.PARALLEL
# the reshard outputs optim_job.py loads (#40)
RESHARD_LOADS = {**scenarios.PARALLEL_RESHARDS, **scenarios.DEGREE_TARGETS}


def _spec(name):
    """(normalized spec, world size) of PARALLEL (or EXTRAS, PIPE_ONE_SPECS, ZERO_DENSE_SPECS) entry ``name``."""
    spec, world_size = scenarios.SOURCE_SPECS[name]
    return normalize(spec), world_size


def _info(ds, name):
    return json.loads((ds.path(name) / "parallel.json").read_text())


def _oracles(ds, name):
    import torch

    world_size = scenarios.REGISTRY[name].world_size
    return [torch.load(ds.path(name) / f"oracle.rank{r}.pt", weights_only=True) for r in range(world_size)]


def _bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(raw), b.contiguous().view(raw))


def _by_global_name(oracles):
    """(global name, tp rank) -> the master every rank holding it gathered; asserts the holders agree."""
    out, holders = {}, {}
    for oracle in oracles:
        tp = oracle["coords"]["tp"]
        for local, master in oracle["masters"].items():
            key = (oracle["params"][local]["global_name"], tp)
            if key in out:
                assert _bits_equal(out[key], master), (key, oracle["coords"]["rank"], holders[key])
            else:
                out[key], holders[key] = master, oracle["coords"]["rank"]
    return out


# --------------------------------------------------------------------------------------------
# What DeepSpeed wrote


def _files(ds, name):
    info = _info(ds, name)
    return sorted(p.name for p in (ds.path(name) / info["tag"]).iterdir())


def _expected_files(name):
    spec, ws = _spec(name)
    bf16 = "bf16_" if spec["dtype"] == "bf16" else ""
    if spec["pp"] > 1:
        dp = ws // spec["pp"]
        layers = [f"layer_0{i}-model_states.pt" for i in range(5)]
        models = [f"mp_rank_0{s}_model_states.pt" for s in range(spec["pp"])]
        optim = [f"{bf16}zero_pp_rank_{d}_mp_rank_0{s}_optim_states.pt" for d in range(dp) for s in range(spec["pp"])]
        return sorted(layers + models + optim)
    if spec["tp"] > 1:
        dp = ws // spec["tp"]
        optim = [f"{bf16}zero_pp_rank_{d}_mp_rank_0{t}_optim_states.pt" for d in range(dp) for t in range(spec["tp"])]
        if spec["stage"] == 3:
            models = [f"zero_pp_rank_{d}_mp_rank_0{t}_model_states.pt" for d in range(dp) for t in range(spec["tp"])]
        else:
            models = [f"mp_rank_0{t}_model_states.pt" for t in range(spec["tp"])]
        return sorted(models + optim)
    if spec["ep"]:
        experts = [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(spec["experts"])]
        if spec["stage"] == 0:  # one file per expert-parallel rank, written by expert-data-parallel rank 0
            optim = [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(spec["ep"])]
        else:
            optim = [f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ws)]
        return sorted(experts + ["mp_rank_00_model_states.pt"] + optim)
    if spec["stage"] == 0:
        return ["mp_rank_00_model_states.pt"]  # the masters (if any) are inside it
    if spec["stage"] == 3:
        return sorted(
            [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ws)]
            + [f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ws)]
        )
    return sorted(
        ["mp_rank_00_model_states.pt"] + [f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ws)]
    )


def _model_states(tag, spec, mp_rank):
    """The model-states file of model-parallel rank ``mp_rank`` (data-parallel rank 0's at ZeRO-3)."""
    prefix = "zero_pp_rank_0_" if spec["stage"] == 3 else ""
    return tag / f"{prefix}mp_rank_{mp_rank:02d}_model_states.pt"


@pytest.mark.parametrize("name", PARALLEL)
def test_deepspeed_wrote_the_files_of_its_layout(ds, name):
    info = _info(ds, name)
    assert info["deepspeed_version"] == DEEPSPEED_VERSION and info["tag"] == "global_step2"
    assert _files(ds, name) == _expected_files(name)


def test_optimizers_are_the_ones_the_issues_name(ds):
    """BF16_Optimizer for a bf16 pipeline at stage 0; FP16_UnfusedOptimizer (per-parameter masters,
    saved in the model states) for dense or MoE bf16/fp16 at stage 0 with a client torch optimizer;
    the fused FP16_Optimizer (flat fp32 groups) when the client optimizer is a FusedAdam (DeepSpeed's
    "Adam": the ``-fused`` entries, whose FusedAdam steps as torch's Adam, its C++ op never built);
    the client optimizer itself for fp32 stage 0 (no masters)."""
    classes = {name: _info(ds, name)["optimizer_class"] for name in PARALLEL}
    for name, cls in classes.items():
        spec, _ = _spec(name)
        if spec["stage"] == 0 and spec["pp"] > 1:
            assert cls == "BF16_Optimizer", name
        elif spec["stage"] == 0 and spec["dtype"] == "fp32":
            assert cls == "Adam", name
        elif spec["stage"] == 0:
            assert cls == ("FP16_Optimizer" if spec["optimizer"] == "fused" else "FP16_UnfusedOptimizer"), name
        elif spec["stage"] == 3:
            assert cls == "DeepSpeedZeroOptimizer_Stage3", name
        else:
            assert cls == "DeepSpeedZeroOptimizer", name


def test_the_model_states_record_the_parallel_degrees(ds):
    import torch

    for name in PARALLEL:
        spec, ws = _spec(name)
        info = _info(ds, name)
        tag = ds.path(name) / info["tag"]
        states = torch.load(_model_states(tag, spec, 0), map_location="cpu", weights_only=False)
        mp = spec["pp"] * spec["tp"]
        assert states["mp_world_size"] == mp, name
        assert states["dp_world_size"] == ws // mp, name
        assert states["checkpoint_parallel_dimensions"] == {"pp_degree": spec["pp"], "tp_degree": spec["tp"]}, name
        assert ("universal_checkpoint_info" in states) == (spec["tp"] > 1), name
        if spec["ep"]:
            assert states["num_experts"] == [spec["experts"]], name
        if spec["pp"] > 1:
            assert states["module"] is None, name
        ranks = info["ranks"]
        assert sorted(r["checkpoint_mp_rank"] for r in ranks) == sorted(
            r["pp"] * spec["tp"] + r["tp"] for r in ranks
        ), name


# --------------------------------------------------------------------------------------------
# The oracles agree with themselves and with DeepSpeed's own tools


@pytest.mark.parametrize("name", PARALLEL)
def test_every_holder_of_a_parameter_gathered_the_same_master(ds, name):
    """Data-parallel replicas (and expert-data-parallel ones) of a parameter give the same bits,
    and every parameter of the whole model is held somewhere, with its whole-model shape."""
    oracles = _oracles(ds, name)
    masters = _by_global_name(oracles)  # asserts agreement
    info = _info(ds, name)
    spec = info["spec"]
    names = {g for g, _ in masters}
    assert names == set(info["global_shapes"])
    for (global_name, _), master in masters.items():
        assert master.dtype.is_floating_point and str(master.dtype) == "torch.float32"
        if spec["tp"] == 1:
            assert list(master.shape) == info["global_shapes"][global_name], global_name
    if spec["ep"]:  # every expert gathered by exactly the ranks that own it
        for oracle in oracles:
            c = oracle["coords"]
            experts = {p["expert"] for p in oracle["params"].values() if p["expert"] is not None}
            per_rank = spec["experts"] // spec["ep"]
            assert experts == set(range(c["ep"] * per_rank, (c["ep"] + 1) * per_rank)), c


@pytest.mark.parametrize("name", PARALLEL)
def test_the_module_weights_are_the_masters_in_the_training_dtype(ds, name):
    """What the forward used: each master rounded to the training dtype (ZeRO 0-2; ZeRO-3 keeps
    placeholders, its weights are checked through the consolidated state dict)."""
    spec, _ = _spec(name)
    if spec["stage"] == 3:
        assert all(o["module"] == {} for o in _oracles(ds, name))
        return
    dt = torch_dtype(spec)
    for oracle in _oracles(ds, name):
        assert sorted(oracle["module"]) == sorted(oracle["masters"])
        for local, weight in oracle["module"].items():
            assert _bits_equal(weight, oracle["masters"][local].to(dt)), local


@pytest.mark.parametrize("name", PARALLEL)
def test_a_parallel_job_gives_the_same_oracles_in_any_launch(ds, name):
    """The ``+again`` entry trains the job again later in its launch, after the other jobs of its
    layout: same masters and logits, bit for bit (so those jobs may share a process)."""
    first, again = _oracles(ds, name), _oracles(ds, scenarios.again_name(name))
    for a, b in zip(first, again):
        assert a["coords"] == b["coords"]
        assert sorted(a["masters"]) == sorted(b["masters"])
        assert all(_bits_equal(a["masters"][n], b["masters"][n]) for n in a["masters"]), a["coords"]
        assert (a["logits"] is None) == (b["logits"] is None)
        assert a["logits"] is None or _bits_equal(a["logits"], b["logits"])


def test_layouts_that_cannot_share_a_process_get_launches_of_their_own():
    """An AutoTP engine leaves its tensor-parallel groups in ``deepspeed.utils.groups``: a MoE
    engine trained after it in the same process fails in ``deepspeed.initialize``
    (``AttributeError: 'NoneType' object has no attribute 'get_model_parallel_rank'``, seen on
    0.19.8); a pipeline or AutoTP engine sets ``groups.mpu``, which a later data-parallel engine
    would partition over. So pipeline, AutoTP and MoE jobs never share a launch with one another
    or with the data-parallel matrix; dense ones (stage 0, universal sources) run in the matrix's
    launches, after its jobs; jobs of one layout share (the ``+again`` test). The FSDP2 loads of the
    DCP export and the FSDP2 saves of DCP checkpoints (``dcp_save_job.py``) run no DeepSpeed engine and scripts of
    their own, the Hugging Face Trainer and accelerate runs (``trainer_job.py``,
    ``accelerate_job.py``) scripts of their own, and the reshard loads
    another script (``reshard_job.py``) and the optimizer-state loads (``optim_job.py``, ``optim_universal_job.py``: one
    launch family per script and layout): launches of their own."""
    registry = scenarios.REGISTRY
    by_group = {}
    for name, task in registry.items():
        if task.deepspeed is None:
            by_group.setdefault(task.launch_group, set()).add(
                task.kind if task.kind not in ("parallel", "optim", "optim_universal") else name
            )
    for group, members in by_group.items():
        layouts = {_layout_of(m) for m in members}
        assert len(layouts) == 1, (group, sorted(members))
        for script in (
            "fsdp2",
            "reshard",
            "dcp_save",
            "trainer",
            "accelerate",
        ):  # jobs of another script: launches of their own
            assert (group[3] == script) == (layouts == {script}), (group, sorted(members))
        # optim_job.py's and optim_universal_job.py's loads (#39): launches of their own, one layout each
        optim = group[3].startswith(("optim-", "optim_universal-"))
        loads = all(m.endswith("+optim") or m in RESHARD_LOADS for m in members)
        assert optim == loads, (group, sorted(members))
    for name in PARALLEL:
        task, again = registry[name], registry[scenarios.again_name(name)]
        assert task.launch_group == again.launch_group and not task.runs_ckptspec
        if name in scenarios.MASTERS_HOOKED:  # its +hook entry is its +again run
            assert again is registry[scenarios.hook_name(name)] and again.args["save_with"] == "ckptspec"
        else:
            assert again.args["save"] is False


def _layout_of(member):
    from _harness.job.parallel_models import layout, normalize

    if member in ("fsdp2", "reshard", "dcp_save", "trainer", "accelerate"):
        return member
    if member.endswith("+optim"):
        return f"optim-{layout(_spec(member.removesuffix('+optim'))[0])}"
    if member in RESHARD_LOADS:
        # loaded by optim_job.py (#40): the target's layout
        return f"optim-{layout(normalize(scenarios.reshard_target(member)[2]))}"
    kind = (
        "dense"
        if member in ("train", "resume")
        else layout(_spec(member.removesuffix("+again").removesuffix("+hook"))[0])
    )
    return "data-parallel" if kind == "dense" else kind


def _place(local, logical, piece):
    """Views of one affine-map piece in a rank's shard and in the whole tensor (DeepSpeed's map)."""
    src_offset, src_strides = piece["source"]
    dst_offset, dst_strides = piece["dest"]
    shape = piece["shape"]
    return (
        local.as_strided(shape, dst_strides, dst_offset),
        logical.as_strided(shape, src_strides, src_offset),
    )


def _affine_map(ds, name, tp):
    import torch

    info = _info(ds, name)
    path = _model_states(ds.path(name) / info["tag"], info["spec"], tp)
    states = torch.load(path, map_location="cpu", weights_only=False)
    return states["universal_checkpoint_info"]["affine_map"]["params"]


def _affine_entry(params, name):
    hits = [entry for pattern, entry in params.items() if re.match(pattern, name)]
    assert len(hits) == 1, (name, len(hits))
    return hits[0]


def _universal_param(folder, name):
    import torch

    value = torch.load(folder / "zero" / name / "fp32.pt", map_location="cpu", weights_only=True)
    return value["param"] if isinstance(value, dict) else value


def _normalized(error):
    """An error message with its paths (which name the cache entry) replaced by <path>."""
    return None if error is None else re.sub(r"'?/\S+", "<path>", error)


_MOE_UNIVERSAL = {  # native (not AutoEP) MoE: DeepSpeed's converter cannot read any of them
    **{f"moe-ep2-s0-{dt}-ws{ws}": "KeyError: 'optimizer_state_dict'" for dt in ("fp32", "bf16") for ws in (2, 4)},
    **{
        f"moe-ep2-s{stage}-{dt}-ws{ws}": f"RuntimeError: shape '{shape}' is invalid for input of size {size}"
        for stage in (1, 2)
        for dt in ("fp32", "bf16")
        for ws, shape, size in ((2, "[16]", 32), (4, "[32, 16]", 1024))
    },
}
UNIVERSAL_OUTCOMES = {
    # name -> None (converted) or the error ds_to_universal raised (paths replaced by <path>)
    **{n: None for n in ("pp2-s1-fp32-ws2", "pp2-s1-bf16-ws2", "pp2dp2-s1-fp32-ws4", "pp2dp2-s1-bf16-ws4")},
    "pp2-s0-bf16-ws2": "RuntimeError: DeepSpeed checkpoint param_shapes must contain dictionaries in <path>",
    **{n: None for n in ("tp2-s1-fp32-ws2", "tp2dp2-s2-bf16-ws4", "tp2-s3-bf16-ws2")},
    **_MOE_UNIVERSAL,
    **{
        n: "FileNotFoundError: can't find *_optim_states.pt files in directory <path>"
        for n in ("s0-fp32-ws2", "s0-bf16-ws2", "s0-fp16-ws2", "s0-bf16-ws2-fused", "s0-fp16-ws2-fused")
    },
    **{n: None for n in ("uc-s2-bf16-ws2", "uc-s3-bf16-ws2")},
}
CONVERTED = sorted(n for n, error in UNIVERSAL_OUTCOMES.items() if error is None)


def test_ds_to_universal_converts_what_it_can(ds):
    """Which layouts DeepSpeed's own converter takes (the issues' oracle (b) exists only for
    those): pipelines at ZeRO-1 and AutoTP at any stage, plain ZeRO-2/3; not the stage-0
    BF16_Optimizer pipeline, not native MoE, not stage 0."""
    got = {}
    for name in PARALLEL:
        outcome = _info(ds, name)["universal"]
        assert outcome is not None and outcome["ok"] == (outcome["error"] is None), name
        got[name] = _normalized(outcome["error"])
        folder = ds.path(name) / outcome["output_folder"]
        assert folder.is_dir() == outcome["ok"] and (ds.path(name) / "latest_universal").is_file() == outcome["ok"]
    assert got == UNIVERSAL_OUTCOMES


@pytest.mark.parametrize("name", CONVERTED)
def test_universal_fp32_equals_the_gathered_masters(ds, name):
    """``zero/<param>/fp32.pt`` of DeepSpeed's universal folder against the live masters: the whole
    tensor where there is no tensor parallelism, each tp rank's shard placed by DeepSpeed's
    ``affine_map`` otherwise."""
    info = _info(ds, name)
    folder = ds.path(name) / info["universal"]["output_folder"]
    spec = info["spec"]
    masters = _by_global_name(_oracles(ds, name))
    for (global_name, tp), master in masters.items():
        whole = _universal_param(folder, global_name)
        if spec["stage"] == 3 and spec["tp"] == 1:
            # A ZeRO-3 source gives flat tensors (not the parameter's shape)
            assert whole.dim() == 1 and whole.numel() == master.numel(), global_name
            whole = whole.view(master.shape)
        if spec["tp"] == 1:
            assert _bits_equal(whole, master), global_name
            continue
        assert list(whole.shape) == info["global_shapes"][global_name], global_name
        entry = _affine_entry(_affine_map(ds, name, tp), global_name)
        assert entry["logical_shape"] == info["global_shapes"][global_name]
        rank_entry = entry["ranks"][tp]
        assert rank_entry["shard_shape"] == list(master.shape), global_name
        for piece in rank_entry["pieces"]:
            local_view, whole_view = _place(master, whole, piece)
            assert _bits_equal(local_view.contiguous(), whole_view.contiguous()), (global_name, tp)


def test_autotp_consolidated_weights_are_the_universal_ones_in_the_training_dtype(ds):
    """DeepSpeed's two merges of tensor-parallel weights, live (_consolidated_16bit_state_dict) and
    from the files (ds_to_universal), agree."""
    import torch

    for name in PARALLEL:
        spec, _ = _spec(name)
        if spec["tp"] == 1:
            continue
        info = _info(ds, name)
        consolidated = torch.load(ds.path(name) / "consolidated.pt", weights_only=True)
        folder = ds.path(name) / info["universal"]["output_folder"]
        assert sorted(consolidated) == sorted(info["global_shapes"]), name
        for n, weight in consolidated.items():
            assert list(weight.shape) == info["global_shapes"][n], (name, n)
            assert _bits_equal(weight, _universal_param(folder, n).to(torch_dtype(spec))), (name, n)


def _whole_model_weights(ds, name):
    """The whole model's weights, merged by DeepSpeed where it merges (ds_to_universal under TP),
    else the gathered masters by global name (pipeline, MoE, dense)."""
    info = _info(ds, name)
    if info["spec"]["tp"] > 1:
        folder = ds.path(name) / info["universal"]["output_folder"]
        return {n: _universal_param(folder, n) for n in info["global_shapes"]}
    return {g: t for (g, _), t in _by_global_name(_oracles(ds, name)).items()}


def _logit_tolerance(spec):
    """0 (bit for bit) unless the whole model sums in another order than the parallel job: a
    row-parallel layer adds two partial products (AutoTP), and a rank running two local experts
    in bf16 rounds differently from one running four (MoE at world size 4). Measured on 0.19.8:
    1.2e-7 (tp2 fp32), 2**-7 (tp2 bf16), 2**-10 (MoE bf16 ws4); the bounds allow one more ulp."""
    if spec["tp"] > 1:
        return 1e-6 if spec["dtype"] == "fp32" else 2**-6
    if spec["ep"] and spec["dtype"] == "bf16" and spec["experts"] > spec["ep"]:
        return 2**-9
    return 0.0


@pytest.mark.parametrize("name", PARALLEL)
def test_the_whole_model_gives_the_parallel_jobs_logits(ds, name):
    """tp1/pp1/ep1 model + merged weights + the fixed batch = the logits the parallel job recorded."""
    import torch

    info = _info(ds, name)
    spec = info["spec"]
    dt = torch_dtype(spec)
    model = reference_model(spec)
    weights = _whole_model_weights(ds, name)
    model.to(dt)
    buffers = _oracles(ds, name)[0].get("buffers", {})  # the forward in eval mode does not read them
    model.load_state_dict({**{n: t.to(dt) for n, t in weights.items()}, **buffers}, strict=True)
    model.eval()
    inputs = torch.load(ds.path(name) / "eval.pt", weights_only=True)["inputs"]
    with torch.no_grad():
        out = model(inputs.to(dt))
    if spec["ep"]:
        out = out[0]
    recorded = [o["logits"] for o in _oracles(ds, name) if o["logits"] is not None]
    assert recorded
    tolerance = _logit_tolerance(spec)
    for logits in recorded:
        assert logits.shape == out.shape and logits.dtype == out.dtype
        if tolerance == 0.0:
            assert _bits_equal(logits, out), name
        else:
            assert (logits.float() - out.float()).abs().max().item() <= tolerance, name


# --------------------------------------------------------------------------------------------
# zero_to_fp32: DeepSpeed's reader of the files, for model-parallel rank 0 only


def _mp_rank_00_copy(ds, name, tmp_path):
    """What a user gives zero_to_fp32: the save directory with the files of mp_rank_00 only
    (symbolic links; ``latest`` names the tag)."""
    tag = _info(ds, name)["tag"]
    (tmp_path / tag).mkdir()
    (tmp_path / "latest").write_text(tag)
    for path in (ds.path(name) / tag).iterdir():
        if "mp_rank_00" in path.name:
            (tmp_path / tag / path.name).symlink_to(path)
    return tmp_path


ZERO_TO_FP32_ERRORS = {
    # zero_to_fp32 globs every *_model_states.pt, the expert files included
    **{n: "ValueError: <path> is not a model state checkpoint" for n in PARALLEL if n.startswith("moe-")},
    # a pipeline's mp_rank files have module None (the weights are in the layer files)
    **{n: "AttributeError: 'NoneType' object has no attribute 'items'" for n in PARALLEL if n.startswith("pp2")},
    # stage 0: param_shapes is None, and there are no optimizer files
    **{n: "TypeError: 'NoneType' object is not iterable" for n in PARALLEL if n.startswith("s0-")},
}


@pytest.mark.parametrize("name", PARALLEL)
def test_zero_to_fp32_on_model_parallel_rank_0(zero_to_fp32, ds, name, tmp_path):
    """DeepSpeed's zero_to_fp32 reads one model-parallel rank: given mp_rank_00's files, each
    tensor it returns equals, bit for bit, the master gathered on the ranks of coordinate
    (pp 0, tp 0). It reads no pipeline, MoE or stage-0 checkpoint (pinned errors)."""
    try:
        state, error = zero_to_fp32(_mp_rank_00_copy(ds, name, tmp_path)), None
    except Exception as exc:  # the outcome under test
        state, error = None, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    assert _normalized(error) == ZERO_TO_FP32_ERRORS.get(name), (name, error)
    if state is None:
        return
    masters = {}
    for o in _oracles(ds, name):
        if o["coords"]["pp"] == 0 and o["coords"]["tp"] == 0:
            for local, t in o["masters"].items():
                masters.setdefault(o["params"][local]["global_name"], t)
    assert sorted(state) == sorted(masters), name
    wrong = sorted(n for n, t in state.items() if not _bits_equal(t.float(), masters[n]))
    assert wrong == [], name


# --------------------------------------------------------------------------------------------
# What ckptspec says today: CK202, naming the file, no traceback (until #17; #16's layouts are described)


def _refusal(name):
    spec, _ = _spec(name)
    if spec["ep"]:
        return None, None  # described by a checkpoint index (#17: tests/deepspeed/test_masters_index.py)
    if spec["pp"] > 1 or spec["tp"] > 1:
        return None, None  # described by a checkpoint index (#16: tests/deepspeed/test_parallel_index.py)
    return None, None  # the universal sources: plain ZeRO-2/3, supported


def _generate(path):
    return subprocess.run([sys.executable, "-m", "ckptspec", "generate", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("name", PARALLEL)
def test_ckptspec_generate_refuses_the_checkpoint_with_ck202(ds, name):
    what, hint = _refusal(name)
    result = _generate(ds.path(name))
    assert "Traceback" not in result.stderr
    if what is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1 and "CK202" in result.stderr, result.stderr
    assert what in result.stderr and hint in result.stderr, result.stderr


@pytest.mark.parametrize("name", CONVERTED)
def test_ckptspec_generate_describes_the_universal_folder(ds, name):
    """A universal folder is a checkpoint index of kind "universal" (#17; #22 named it in the CK202 it
    used to get), with or without model-parallel files."""
    folder = ds.path(name) / _info(ds, name)["universal"]["output_folder"]
    result = _generate(folder)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert json.loads(result.stdout)["kind"] == "universal"
