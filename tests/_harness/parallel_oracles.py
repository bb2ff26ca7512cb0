"""Reading the oracles a "parallel" job recorded (tests/_harness/job/parallel.py), with torch, never
through ckptspec: the job's info, every rank's oracle, DeepSpeed's own affine pieces."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


def info(entry: Path) -> dict:
    return json.loads((entry / "parallel.json").read_text())


def rank_oracles(entry: Path) -> list[dict]:
    import torch

    return [torch.load(entry / f"oracle.rank{r}.pt", weights_only=True) for r in range(info(entry)["world_size"])]


def gathered_whole(entry: Path, local_names: bool = False) -> dict:
    """A tensor-parallel pipeline job's whole masters, Adam moments and module, as its ranks gathered them over their
    tensor groups (job/tp_layers.py): "master", "exp_avg", "exp_avg_sq", "module" -> global name -> tensor (every
    holder's the same, bit for bit). ``local_names``: the job recorded them by each stage's local name (the extras
    models, trainable and frozen), turned into global names by its ``params``."""
    out: dict = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}, "module": {}}
    for oracle in rank_oracles(entry):
        values = {"master": oracle["whole_masters"], "module": oracle["whole_module"], **oracle["whole_moments"]}
        for key, by_name in values.items():
            for n, v in by_name.items():
                n = oracle["params"][n]["global_name"] if local_names else n
                assert n not in out[key] or bits_equal(out[key][n], v), (key, n)
                out[key][n] = v
    return out


def structure(value, dtypes: bool = True):
    """A saved file's structure: its keys, nesting and tensor shapes (and dtypes: ``dtypes``), values aside."""
    import torch

    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype) if dtypes else None)
    if isinstance(value, dict):
        return {k: structure(v, dtypes) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [structure(v, dtypes) for v in value]
    return type(value).__name__


def assert_same(a, b, where: str) -> None:
    """``a`` is ``b``: the same types, keys in the same order, values, tensors bit for bit (``where``: the path so far,
    in the assertion's message)."""
    import torch

    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert bits_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def tensor_piece(whole, shape, tensor: int, tp: int):
    """Tensor rank ``tensor`` of ``tp``'s piece of ``whole`` for a tensor of ``shape`` (the whole where it is
    replicated): the one axis the shapes differ on, cut in ``tp`` equal parts."""
    axes = [i for i, (a, b) in enumerate(zip(shape, whole.shape, strict=True)) if a != b]
    if not axes:
        return whole
    assert len(axes) == 1 and whole.shape[axes[0]] == tp * shape[axes[0]], (shape, whole.shape)
    return whole.chunk(tp, dim=axes[0])[tensor]


def assert_pieces_of_whole(records: list[dict], whole: dict, tp: int) -> None:
    """Every target rank of ``tp`` tensor ranks holds its piece of each of ``whole``'s masters and Adam moments (as
    DeepSpeed's getters give them), at step 2 (the sources trained two steps), and together they hold all of them."""
    held = set()
    for r in records:
        tensor = r["coords"]["tp"]
        for n, master in r["master"].items():
            held.add((tensor, n))
            assert bits_equal(master, tensor_piece(whole["master"][n], master.shape, tensor, tp)), (tensor, n)
            for key in ("exp_avg", "exp_avg_sq"):
                expected = tensor_piece(whole[key][n], master.shape, tensor, tp)
                assert bits_equal(r["state"][n][key], expected), (tensor, n, key)
            assert r["step"][n] == 2.0 and r["source"][n] == "safe_get_full_optimizer_state", (tensor, n)
    assert held == {(t, n) for t in range(tp) for n in whole["master"]}


def assert_same_by_name(got: dict, expected: dict, what: str) -> None:
    """Each kind of state (``master``, ``exp_avg``, ...) of ``expected``, a non-empty dict of tensors by name, is in
    ``got`` under the same names, bit for bit (in any order: tensors joined whole from the shards of another layout)."""
    for key, by_name in expected.items():
        assert sorted(got[key]) == sorted(by_name) and by_name, (what, key)
        for name, value in by_name.items():
            assert bits_equal(got[key][name], value), (what, key, name)


def assert_universal_folders_equal(ours: Path, theirs: Path, files: int) -> None:
    """ckptspec's universal folder ``ours`` is ds_to_universal's ``theirs``: the same ``files`` files, the model
    states byte for byte, every tensor bit for bit, every other value of the same repr."""
    import torch

    names = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file()) and len(names) == files
    for rel in names:
        if rel.name.startswith("mp_rank_"):
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        a, b = torch.load(theirs / rel, weights_only=False), torch.load(ours / rel, weights_only=False)
        if torch.is_tensor(a):
            assert bits_equal(a, b), rel
            continue
        assert sorted(a) == sorted(b), rel
        for key in a:
            assert bits_equal(a[key], b[key]) if torch.is_tensor(a[key]) else repr(a[key]) == repr(b[key]), (rel, key)


def bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def affine_pieces(entry: Path, tp: int, global_name: str) -> list[dict]:
    """DeepSpeed's own pieces of ``global_name`` on tensor rank ``tp`` (torch.load of its model states)."""
    import torch

    meta = info(entry)
    prefix = "zero_pp_rank_0_" if meta["spec"]["stage"] == 3 else ""
    states = torch.load(
        entry / meta["tag"] / f"{prefix}mp_rank_{tp:02d}_model_states.pt", map_location="cpu", weights_only=False
    )
    params = states["universal_checkpoint_info"]["affine_map"]["params"]
    (found,) = [e for pattern, e in params.items() if re.match(pattern, global_name)]
    return found["ranks"][tp]["pieces"]


def shard_of(whole, pieces: list[dict], local_shape):
    """A rank's shard cut out of the whole tensor by DeepSpeed's affine pieces."""
    import torch

    local = torch.empty(local_shape, dtype=whole.dtype)
    for p in pieces:
        dst = local.as_strided(p["shape"], p["dest"][1], p["dest"][0])
        dst.copy_(whole.as_strided(p["shape"], p["source"][1], p["source"][0]))
    return local


def check_masters(entry: Path, whole: dict) -> int:
    """Assert every rank's live master is, bit for bit, its shard of ``whole`` (global name -> tensor);
    returns how many were compared."""
    spec = info(entry)["spec"]
    checked = 0
    for oracle in rank_oracles(entry):
        tp = oracle["coords"]["tp"]
        for local, master in oracle["masters"].items():
            g = oracle["params"][local]["global_name"]
            if spec["tp"] > 1 and spec["pp"] > 1:  # Megatron-style layers: the master gathered whole (its tensor group)
                mine, master = whole[g], oracle["whole_masters"][local]
            else:
                mine = whole[g] if spec["tp"] == 1 else shard_of(whole[g], affine_pieces(entry, tp, g), master.shape)
            assert bits_equal(mine, master), (entry.name, oracle["coords"], local)
            checked += 1
    return checked


def plain_settings(settings: dict) -> dict:
    """A torch param group's settings as JSON holds them (tuples as lists, no None)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items() if v is not None}


def check_exported_optimizer_state(out: Path, oracle: dict, name: str) -> dict:
    """``reconstruct --optimizer-state``'s ``optimizer.safetensors`` in ``out`` against an ``optim`` job's record
    (``optim_job.py``, ``optim_universal_job.py``): every trainable parameter's moments bit for bit, its group,
    each group's step and hyperparameters. Returns the exported ``ckptspec.optimizer`` metadata."""
    from safetensors import safe_open

    with safe_open(out / "optimizer.safetensors", "pt") as f:
        meta = f.metadata()
        exported = {k: f.get_tensor(k) for k in f.keys()}
    states = json.loads(meta["ckptspec.states"])
    assert sorted(states) == sorted(oracle["state"])  # every trainable parameter, experts by global name
    for param, by_key in oracle["state"].items():
        assert set(states[param]) == set(by_key) == {"exp_avg", "exp_avg_sq"}
        for key, theirs in by_key.items():
            assert bits_equal(exported[states[param][key]], theirs), f"{name}: {param}.{key}"
    assert len(exported) == 2 * len(oracle["state"])
    assert json.loads(meta["ckptspec.optimizer_groups"]) == oracle["group"]
    optimizer = json.loads(meta["ckptspec.optimizer"])
    steps = {g["optimizer_group"]: g["step"] for g in optimizer["groups"]}
    assert steps == {oracle["group"][p]: step for p, step in oracle["step"].items()}
    assert [g["hyperparameters"] for g in optimizer["groups"]] == [plain_settings(g) for g in oracle["param_groups"]]
    return optimizer


def read_dcp(path) -> dict:
    """Every tensor key of a DCP directory, read whole with torch's reader (no process group)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def optim_records(entry: Path, prefix: str = "optim") -> list[dict]:
    """Every rank's record an optim_job.py task wrote (``<prefix>.rank<R>.pt``), in rank order."""
    import torch

    files = sorted(entry.glob(f"{prefix}.rank*.pt"))
    assert files, f"no {prefix} record in {entry}"
    return [torch.load(f, weights_only=False) for f in files]


def merged(records: list[dict], pick, shapes: dict[str, tuple[int, ...]]) -> dict:
    """name -> the whole tensor an AutoTP job's optim_job.py records hold (``pick``: a record's name -> tensor), put
    together by the rule of tests/export/test_reshard_tensor.py's docstring: a shard of the whole tensor's shape
    (``shapes``) is a replicated copy (every tensor rank's equal), else the shards are concatenated in tensor-rank
    order along the one axis where they are smaller."""
    import torch

    by_rank: dict[int, dict] = {}  # every data rank of a tensor rank holds the same
    for record in records:
        values = by_rank.setdefault(record["coords"]["tp"], {})
        for name, value in pick(record).items():
            assert bits_equal(values.setdefault(name, value), value), (name, record["coords"])
    out = {}
    for name in by_rank[0]:
        shards, shape = [by_rank[tp][name] for tp in sorted(by_rank)], shapes[name]
        if tuple(shards[0].shape) == shape:
            assert all(bits_equal(s, shards[0]) for s in shards), f"replicated copies of {name} differ"
            out[name] = shards[0]
            continue
        axes = [a for a, (n, m) in enumerate(zip(shards[0].shape, shape)) if n != m]
        assert len(axes) == 1, (name, shards[0].shape, shape)
        out[name] = torch.cat(shards, dim=axes[0])
    return out


def union_of(per_rank: list[dict]) -> dict:
    """name -> its tensor on every rank that holds it (each the same, bit for bit: asserted)."""
    out: dict = {}
    for values in per_rank:
        for name, value in values.items():
            assert bits_equal(out.setdefault(name, value), value), name
    return out


def check_same_moments_and_step(target: list[dict], before: list[dict], names) -> None:
    """Two optim_job.py tasks' records hold the same Adam moments for ``names`` (by name, on every rank holding
    each), bit for bit, and one step, not 0, on every rank of both."""
    for key in ("exp_avg", "exp_avg_sq"):
        held = union_of([{n: v[key] for n, v in r["state"].items()} for r in target])
        moments = union_of([{n: v[key] for n, v in r["state"].items()} for r in before])
        assert held.keys() == moments.keys() == set(names)
        for n, value in moments.items():
            assert bits_equal(held[n], value), (n, key)
    steps = {s for r in [*before, *target] for s in r["step"].values()}
    assert len(steps) == 1 and steps != {0}, steps


# The logits of a bf16 MoE at another expert-parallel degree: the same masters and inputs, but each rank's experts
# and the all-to-all that brings their bf16 outputs back differ, so bf16 sums are rounded in another order (fp32:
# bit for bit). The bound: two bf16 epsilons (2 ** -7 each) at the largest logit (measured: 9.8e-4 at logits up to
# 0.27; 0.0041 allowed).
MOE_LOGITS_BOUND = 2 * 2.0**-7


def check_moe_groups_and_logits(target: list[dict], before: list[dict], target_spec: dict, source_spec: dict) -> None:
    """A MoE job of ``target_spec``'s layout (records ``target``) holds the param groups and gives the logits of a job
    of the source's (``before``): the same hyperparameters, the expert group named by the target's expert-parallel
    degree as DeepSpeed names it; logits bit for bit at the same expert degree or in fp32, else within
    MOE_LOGITS_BOUND."""
    renamed = [{**g, "name": f"ep_size_{target_spec['ep']}"} if g.get("moe") else g for g in before[0]["param_groups"]]
    assert any(g.get("moe") for g in renamed) and all(r["param_groups"] == renamed for r in target)
    logits, expected = logits_of(target), logits_of(before)
    assert logits.abs().max() > 0
    if target_spec["ep"] == source_spec["ep"] or target_spec["dtype"] == "fp32":
        assert bits_equal(logits, expected)
    else:
        bound = MOE_LOGITS_BOUND * expected.abs().max().item()
        assert (logits - expected).abs().max().item() <= bound, (logits - expected).abs().max()


def logits_of(records: list[dict]):
    """The logits of the fixed batch an optim_job.py task recorded: every rank's (data parallel, all the same)
    or the last pipeline stage's."""
    return union_of([{"logits": r["logits"]} for r in records if r.get("logits") is not None])["logits"]


def _raw(array) -> tuple:
    array = np.asarray(array)
    return array.dtype.str, array.shape, array.tobytes()


def check_same_to_ckptspec(
    before, after, *, unit_scaler_added: bool = False, optimizer_keys=None, expert_group_name: str | None = None
) -> None:
    """Two opened checkpoints (``ckptspec.open``) hold the same whole model and optimizer state, bit for bit:
    the same names (a root module's buffer may come first in one and last in the other), hyperparameters, step.
    ``unit_scaler_added``: ``after`` may hold a static loss scaler of scale 1 where ``before`` records none (a ZeRO
    file always pickles one; a stage-0 job's optimizer saves none, or no loss scaler object). ``optimizer_keys``:
    the optimizer metadata compared (default: all of it; a stage-0 checkpoint's records no loss scaler or
    clip_grad). ``expert_group_name``: the name a MoE expert group (``moe: True``) has in ``after`` (DeepSpeed names
    it by the expert-parallel degree, ``ep_size_E``), where the degree changed."""
    expected, got = before.state_dict(framework="numpy"), after.state_dict(framework="numpy")
    assert sorted(got) == sorted(expected) and expected
    for key, array in expected.items():
        assert _raw(got[key]) == _raw(array), key
    (states, optimizer), (states_after, optimizer_after) = before.optimizer_state(), after.optimizer_state()
    if unit_scaler_added and "loss_scaler" not in optimizer:
        scaler = optimizer_after.pop("loss_scaler")
        assert scaler == {"kind": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}}, scaler
    for group in optimizer.get("groups", []) if expert_group_name else []:
        if group["hyperparameters"].get("moe"):
            group["hyperparameters"]["name"] = expert_group_name
    if optimizer_keys is not None:
        optimizer, optimizer_after = ({k: o.get(k) for k in optimizer_keys} for o in (optimizer, optimizer_after))
    assert optimizer_after == optimizer and sorted(states_after) == sorted(states)
    for key, per_state in states.items():
        for state, array in per_state.items():
            assert _raw(states_after[key][state]) == _raw(array), (key, state)


def running_layers(spec: dict, name: str) -> set[int]:
    """The pipeline layers that run global parameter ``name`` (``<layer>.<attr>``): its own layer, or every layer
    of its TiedLayerSpec's key (job/parallel_models.py ``_pipe_layers``)."""
    from _harness.job.parallel_models import _pipe_layers, normalize

    keys = [key for *_, key in _pipe_layers(normalize(spec))]
    layer = int(name.split(".", 1)[0])
    return {i for i, key in enumerate(keys) if key == keys[layer]} if keys[layer] else {layer}


def saved_entries(doc, prefix=""):
    """(path, a tensor's dtype and shape, an object's attributes, or the value) of every leaf of a saved file."""
    import torch

    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from saved_entries(value, f"{prefix}/{key}")
    elif isinstance(doc, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list)) for v in doc):
        for i, value in enumerate(doc):
            yield from saved_entries(value, f"{prefix}/{i}")
    elif isinstance(doc, torch.Tensor):
        yield prefix, (doc.dtype, tuple(doc.shape))
    elif hasattr(doc, "__dict__") and not isinstance(doc, type):  # the loss scaler: its class and numbers
        yield prefix, (type(doc).__name__, vars(doc))
    else:
        yield prefix, doc


def shape_of(value):
    """Every entry's type, every tensor's dtype and shape, nested as saved (two saves of one layout by other runs)."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [shape_of(v) for v in value]
    return type(value).__name__


def assert_refused_while_planning(source: Path, out: Path, monkeypatch, world_size: int, options: dict, refusal: str):
    """``reshard_model_parallel(source, out, ...)`` refuses (CK410 naming ``source``, ``refusal`` in its message) while
    planning: no step of a chained move (``RestagedStage0Write.write``) runs, nothing is written."""
    import pytest

    import ckptspec
    from ckptspec.export import reshard_pipeline_stage0
    from ckptspec.export.reshard_parallel import reshard_model_parallel

    def no_step(*args, **kwargs):
        raise AssertionError("a step ran")

    monkeypatch.setattr(reshard_pipeline_stage0.RestagedStage0Write, "write", no_step)
    with pytest.raises(ckptspec.Unsupported) as refused:
        reshard_model_parallel(source, out, world_size, **options)
    assert refused.value.code == "CK410" and refusal in refused.value.message, refused.value.message
    assert refused.value.file == str(source)
    assert not out.exists() or not any(out.iterdir())
