"""Issue #39: the optimizer state of a universal folder (``ds_to_universal``'s ``zero/<param>/exp_avg.pt``,
``exp_avg_sq.pt``, ``step.pt`` and ``zero/optimizer_state.pt``), through ``reconstruct --optimizer-state``,
``ckptspec.load_optimizer_state``, ``Checkpoint.optimizer_tensors`` and ``generate --hash``.

Oracles (``<name>+optim``, tests/_harness/optim_universal_job.py): the optimizer state DeepSpeed holds after
loading the ZeRO tag the folder was converted from (``safe_get_full_optimizer_state`` of every parameter:
what the run held when it saved), and after loading the folder itself with ``checkpoint.load_universal``
(DeepSpeed's own reader of it). The export equals both, bit for bit, every moment of every parameter, with
the step and hyperparameters of the param group. A lost or damaged moment file is refused by code, naming
the file, with nothing written.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _harness import scenarios
from _harness.parallel_oracles import bits_equal, check_exported_optimizer_state, info, plain_settings
from _harness.reconstruction import invoke

import ckptspec

SOURCES = scenarios.OPTIM_UNIVERSAL_SOURCES
KEYS = {"exp_avg", "exp_avg_sq"}


def _folder(ds, name):
    entry = ds.path(name)
    return entry / info(entry)["universal"]["output_folder"]


def _oracle(ds, name: str, load: str) -> dict:
    """Every rank's record of one load (``source`` or ``universal``); every rank holds every parameter."""
    import torch

    entry = ds.path(scenarios.optim_name(name))
    assert json.loads((entry / "optim.json").read_text())["errors"] == {"source": None, "universal": None}
    records = [
        torch.load(entry / f"{load}.rank{r}.pt", weights_only=True) for r in range(scenarios.REGISTRY[name].world_size)
    ]
    for other in records[1:]:  # a dense run: every rank gathered the same whole tensors
        assert other["step"] == records[0]["step"] and other["group"] == records[0]["group"]
        assert all(bits_equal(other["state"][p][k], t) for p, s in records[0]["state"].items() for k, t in s.items())
    return records[0]


@pytest.mark.parametrize("load", ["source", "universal"])
@pytest.mark.parametrize("name", SOURCES)
def test_exported_state_is_what_deepspeed_holds(ds, name, load, tmp_path):
    oracle = _oracle(ds, name, load)
    out = tmp_path / "out"
    result = invoke("reconstruct", _folder(ds, name), out, "--quiet", "--optimizer-state")
    assert result.exit_code == 0 and result.output == "", result.output
    optimizer = check_exported_optimizer_state(out, oracle, name)
    assert {g["optimizer_group"]: g["step"] for g in optimizer["groups"]} == {0: 2.0}
    assert optimizer["loss_scaler"] == {"kind": "LossScaler", "state": {"cur_scale": 1.0, "dynamic": False}}


@pytest.mark.parametrize("name", SOURCES)
def test_load_optimizer_state_and_the_chunks_of_every_moment(ds, name):
    """The Python API gives the same arrays in each parameter's shape; ``optimizer_tensors``' chunks are
    the bytes of DeepSpeed's state, in the folder's ``zero/<param>/<state>.pt``."""
    oracle = _oracle(ds, name, "source")
    folder = _folder(ds, name)
    state, optimizer = ckptspec.load_optimizer_state(folder)
    assert sorted(state) == sorted(oracle["state"])
    for param, by_key in oracle["state"].items():
        for key, theirs in by_key.items():
            ours = state[param][key]
            assert ours.dtype == np.float32 and list(ours.shape) == list(theirs.shape), (param, key)
            assert np.array_equal(ours.view(np.uint32), theirs.numpy().view(np.uint32)), (param, key)
    assert [g["step"] for g in optimizer["groups"]] == [2.0]
    tensors = ckptspec.open(folder).optimizer_tensors
    assert sorted(tensors) == sorted(f"{p}.{k}" for p in oracle["state"] for k in KEYS)
    for whole, tensor in tensors.items():
        param, key = whole.rsplit(".", 1)
        (chunk,) = tensor.chunks
        assert chunk.file == f"zero/{param}/{key}.pt" and chunk.numel == oracle["state"][param][key].numel()
        data = (folder / chunk.file).read_bytes()[chunk.offset : chunk.offset + chunk.nbytes]
        assert data == oracle["state"][param][key].contiguous().numpy().tobytes(), whole


def _sha256(tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 1]))


def _copy(ds, name, tmp_path):
    copy = tmp_path / "uc"
    shutil.copytree(_folder(ds, name), copy)
    return copy


@pytest.mark.parametrize("name", SOURCES)
def test_generate_hash_digests_every_moment_and_a_changed_byte_is_found(ds, name, tmp_path):
    """``generate --hash`` gives every parameter the sha256 of each moment as DeepSpeed held it; a flipped
    bit of one moment (the file hashes removed: only the digests can tell) is CK222 for ``validate INDEX
    --checkpoint`` and as ``reconstruct --optimizer-state`` streams the bytes, which writes nothing."""
    oracle = _oracle(ds, name, "source")
    copy = _copy(ds, name, tmp_path)
    doc = tmp_path / "index.json"
    assert invoke("generate", copy, "-o", doc, "--hash").exit_code == 0
    index = json.loads(doc.read_text())
    (domain,) = index["domains"]
    params = [p for g in domain["manifest"]["groups"] for p in g["params"]]
    assert {p["name"] for p in params} == set(oracle["state"])
    for p in params:
        assert {k: d["sha256"] for k, d in p["state_digests"].items()} == {
            k: _sha256(t) for k, t in oracle["state"][p["name"]].items()
        }, p["name"]
    for f in domain["manifest"]["files"]:
        f.pop("hash", None)
    doc.write_text(json.dumps(index))
    assert invoke("validate", doc, "--checkpoint", copy).exit_code == 0
    k, param = next((k, p) for k, p in enumerate(params) if p["name"] == "head.weight")
    chunk = ckptspec.open(copy).optimizer_tensors["head.weight.exp_avg_sq"].chunks[0]
    _flip(copy / chunk.file, chunk.offset + 4)
    result = invoke("validate", doc, "--checkpoint", copy)
    assert result.exit_code == 1, result.output
    assert f"$.domains[0].manifest.groups[0].params[{k}].state_digests.exp_avg_sq: CK222" in result.output
    out = tmp_path / "out"
    result = invoke("reconstruct", copy, out, "--manifest", doc, "--quiet", "--optimizer-state")
    assert result.exit_code == 1 and "CK222" in result.output and "head.weight" in result.output, result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "damage",
    ["exp_avg_sq deleted", "step deleted", "exp_avg truncated", "optimizer_state deleted"],
)
def test_a_lost_or_damaged_moment_file_is_refused_by_name(ds, damage, tmp_path):
    """A folder whose index is generated from what is there (no sidecar, the usual case): one parameter
    lacking a state its siblings have is CK206 naming the file, a truncated one CK205; nothing is written,
    and the weights alone still reconstruct (the masters are whole)."""
    copy = _copy(ds, "uc-s2-bf16-ws2", tmp_path)
    what, how = damage.split()
    target = copy / "zero" / ("optimizer_state.pt" if what == "optimizer_state" else f"head.bias/{what}.pt")
    if how == "deleted":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:-200])
    out = tmp_path / "out"
    result = invoke("reconstruct", copy, out, "--quiet", "--optimizer-state")
    assert result.exit_code == 1, result.output
    code = "CK205" if how == "truncated" else "CK206"
    assert f"{code} " in result.output and target.relative_to(copy).as_posix() in result.output, result.output
    assert not out.exists()
    with pytest.raises(ckptspec.InvalidCheckpoint) as refused:
        ckptspec.load_optimizer_state(copy)
    assert refused.value.code == code
    assert invoke("reconstruct", copy, out, "--quiet").exit_code == 0


@pytest.mark.parametrize("point", ["s2-bf16-ws2", "s2-fp16-ws2-groups", "s3-fp16-ws3-groups"])
def test_export_universal_folders_give_the_live_state_back(ds, point, tmp_path):
    """``ckptspec export-universal`` of matrix checkpoints (a tie, a frozen parameter with ``fp32.pt`` alone, two
    param groups, whose membership is the copied model states' ``param_shapes``), read back: the state the
    training job recorded from the live engine before saving (``live_optim.pt``), bit for bit, with each
    group's step and hyperparameters."""
    import torch

    folder = tmp_path / "uc"
    assert invoke("export-universal", ds.path(point), folder).exit_code == 0
    assert (folder / "zero" / "frozen.weight").is_dir() and not (
        folder / "zero" / "frozen.weight" / "exp_avg.pt"
    ).exists()
    live = torch.load(ds.path(point) / "live_optim.pt", weights_only=True)
    state, optimizer = ckptspec.load_optimizer_state(folder)
    assert sorted(state) == sorted(live["state"])  # the tied alias included, the frozen parameter not
    for param, by_key in live["state"].items():
        assert set(state[param]) == set(by_key) == KEYS
        for key, theirs in by_key.items():
            assert bits_equal(torch.from_numpy(state[param][key]), theirs), (point, param, key)
    assert {g["optimizer_group"]: g["step"] for g in optimizer["groups"]} == live["steps"]
    for g in optimizer["groups"]:
        assert g["hyperparameters"] == plain_settings(live["param_groups"][g["optimizer_group"]])
