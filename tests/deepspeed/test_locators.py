"""Format 1.1's producer output against real DeepSpeed checkpoints and the live engine.

For every matrix point, ``ckptspec generate --hash`` (the directory producer, no torch):

* every locator of 1.1 (frozen params and buffers by name, stage-3 fragments per rank, the flat
  low-precision weights of each group, each rank's partition of each optimizer state) points at
  the very bytes ``torch.load`` gives for that tensor;
* every digest is the SHA-256 of the tensor's real elements as the live engine held them
  (``live_fp32.pt``, ``live_optim.pt``, recorded in the job) or as torch loads them;
* the optimizer's hyperparameters and step, the loss scaler and the training counters are the
  live engine's.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from _harness.scenarios import MATRIX

from ckptspec.deepspeed.describe import describe
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir


@pytest.fixture(scope="module", params=MATRIX)
def point(request, ds):
    import torch

    save_dir = ds.path(request.param)
    tag_dir = resolve_tag_dir(save_dir)
    manifest = describe(save_dir, hash_algorithm="sha256")
    loaded = {f.path: torch.load(tag_dir / f.path, map_location="cpu", weights_only=False) for f in manifest.files}
    live = torch.load(save_dir / "live_fp32.pt", weights_only=True)
    live_optim = torch.load(save_dir / "live_optim.pt", weights_only=True)
    return request.param, tag_dir, manifest, loaded, live, live_optim


def _bytes(tensor) -> bytes:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read(path, loc) -> bytes:
    from ckptspec.format.dtypes import ITEMSIZE

    item = ITEMSIZE[loc.dtype]
    with open(path, "rb") as fh:
        fh.seek(loc.data_offset + loc.element_offset * item)
        return fh.read(loc.numel * item)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_named_locators_are_the_tensors_torch_loads(point):
    name, tag_dir, manifest, loaded, _, _ = point
    stage, world = manifest.layout.zero_stage, manifest.layout.world_size
    stored = {f.name: f.stored_in for f in manifest.frozen}
    seen = {}
    for f in manifest.files:
        for loc in f.tensors or ():
            state = loaded[f.path]
            holder = (
                "frozen_param_fragments" if stored.get(loc.name) in ("fragments", "partitioned_fragments") else "module"
            )
            tensor = state[holder][loc.name].reshape(-1)[: loc.numel]
            assert _read(tag_dir / f.path, loc) == _bytes(tensor), (name, loc.name)
            seen.setdefault(loc.name, []).append(f.ranks[0])
    expected = {fr.name: list(range(world)) if stage == 3 else [0] for fr in manifest.frozen}
    expected |= {b.name: [0] for b in manifest.buffers}
    assert seen == expected


def test_model_weights_are_the_flat_low_precision_buffer(point):
    name, tag_dir, manifest, loaded, _, _ = point
    located = [(f, loc) for f in manifest.files for loc in f.model_weights or ()]
    if manifest.layout.zero_stage == 3:
        assert located == []  # stage 3 saves (0,) placeholders only
        return
    assert [loc.group for _, loc in located] == list(range(len(manifest.groups)))
    for f, loc in located:
        data = _read(tag_dir / f.path, loc)
        module = loaded[f.path]["module"]
        item = 2 if loc.dtype in ("bfloat16", "float16") else 4
        for p in manifest.groups[loc.group].params:
            view = data[p.offset * item : (p.offset + p.numel) * item]
            assert view == _bytes(module[p.name]), (name, p.name)


def test_state_partitions_are_the_optimizer_states_torch_loads(point):
    name, tag_dir, manifest, loaded, _, _ = point
    for f in manifest.files:
        if f.role != "optimizer_states":
            continue
        osd = loaded[f.path]["optimizer_state_dict"]
        inner = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
        located = {(loc.group, loc.state): loc for loc in f.state_partitions}
        expected = {(g, k) for g, st in inner["state"].items() for k, t in st.items() if t.dim() > 0}
        assert (
            set(located) == expected == {(g, k) for g in range(len(manifest.groups)) for k in ("exp_avg", "exp_avg_sq")}
        )
        for (g, key), loc in located.items():
            assert loc.numel == manifest.groups[g].partition_numel  # padding kept, on every rank
            assert _read(tag_dir / f.path, loc) == _bytes(inner["state"][g][key]), (name, f.path, g, key)


def test_digests_are_the_live_engines_tensors(point):
    """Master and optimizer-state digests against the live engine's values; frozen params, buffers and
    low-precision weights against what torch loads (trimmed of stage 3's padding)."""
    name, tag_dir, manifest, loaded, live, live_optim = point
    for group in manifest.groups:
        for p in group.params:
            if p.numel == 0:
                assert p.digest.sha256 == _sha(b"")
                continue
            assert p.digest.sha256 == _sha(_bytes(live[p.name])), (name, p.name)
            assert set(p.state_digests) == set(live_optim["state"][p.name])
            for key, digest in p.state_digests.items():
                assert digest.sha256 == _sha(_bytes(live_optim["state"][p.name][key])), (name, p.name, key)
    model_files = [f for f in manifest.files if f.role == "model_states"]
    module = loaded[model_files[0].path]["module"]
    for group in manifest.groups:
        for p in group.params:
            if manifest.layout.zero_stage < 3:
                assert p.model_digest.sha256 == _sha(_bytes(module[p.name])), (name, p.name)
            else:
                assert p.model_digest is None
    for b in manifest.buffers:
        assert b.digest.sha256 == _sha(_bytes(module[b.name])), (name, b.name)
    import torch

    for fr in manifest.frozen:
        if fr.stored_in == "partitioned_fragments":
            whole = torch.cat([loaded[f.path]["frozen_param_fragments"][fr.name] for f in model_files])[: fr.numel]
        else:
            whole = module[fr.name]
        assert fr.digest.sha256 == _sha(_bytes(whole)), (name, fr.name)


def test_optimizer_scalars_and_counters_are_the_live_engines(point):
    name, tag_dir, manifest, loaded, _, live_optim = point
    optimizer = manifest.optimizer
    assert optimizer.class_ == "unknown"  # a client optimizer's class is recorded nowhere in DeepSpeed's files
    assert {g.optimizer_group: g.step for g in optimizer.groups} == live_optim["steps"]
    for g in optimizer.groups:
        live = {
            k: list(v) if isinstance(v, tuple) else v for k, v in live_optim["param_groups"][g.optimizer_group].items()
        }
        assert g.hyperparameters == {k: v for k, v in live.items() if v is not None}, name
    first_optim = next(f for f in manifest.files if f.role == "optimizer_states")
    osd = loaded[first_optim.path]["optimizer_state_dict"]
    if "loss_scaler" in osd:
        saved = {
            k: (str(v).removeprefix("torch.") if "dtype" in type(v).__name__ else v)
            for k, v in vars(osd["loss_scaler"]).items()
        }
        assert optimizer.loss_scaler.kind == type(osd["loss_scaler"]).__name__
        assert optimizer.loss_scaler.state == saved
    else:  # BF16_Optimizer saves no loss scaler
        assert optimizer.loss_scaler is None and manifest.layout.optimizer == "BF16_Optimizer"
    assert optimizer.clip_grad == osd.get("clip_grad")
    model = loaded[next(f for f in manifest.files if f.role == "model_states").path]
    assert manifest.save.model_dump(exclude_unset=True) == {
        k: model[k] for k in ("global_steps", "global_samples", "skipped_steps")
    }
    assert json.loads(json.dumps(manifest.to_dict()))["layout"]["byte_order"] == "little"
