"""Issue #39's matrix: every read command and Python function on every kind of checkpoint, through the one
``Checkpoint`` view, on the real checkpoints the harness builds. Oracles: the live engine's fp32 masters on
every rank (``oracle.rank*.pt`` of a PARALLEL job, ``live_fp32.pt`` of a ZeRO one; a tensor-parallel rank's
master is its shard, cut from the whole tensor by DeepSpeed's own affine pieces), and DeepSpeed's
``ds_to_universal`` ``fp32.pt`` for universal folders; for the optimizer state, DeepSpeed's moments (the live
engine's, the state it loads, or ``ds_to_universal``'s merge). What a kind cannot do yet is refused by capability
(CK403) with nothing written; the test fails when that list and the code disagree.
"""

from __future__ import annotations

import json

import pytest
from _harness.parallel_oracles import bits_equal, check_masters, info
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli

KINDS = {  # kind label in the issue -> harness checkpoint
    "zero2 bf16": "s2-bf16-ws2",
    "tp2": "tp2-s1-fp32-ws2",
    "tp2xdp2": "tp2dp2-s2-bf16-ws4",
    "tp2 zero3": "tp2-s3-bf16-ws2",
    "pp2": "pp2-s1-fp32-ws2",
    "pp2xdp2 bf16": "pp2dp2-s1-bf16-ws4",
    "pp2 stage0 bf16": "pp2-s0-bf16-ws2",
    "pp2 stage0 fp32": "pp2-s0-fp32-ws2",  # the torch optimizer's state in each stage's model states
    "moe ep2 s0 ws4": "moe-ep2-s0-bf16-ws4",
    "moe ep2 s1 ws4": "moe-ep2-s1-fp32-ws4",
    "moe ep2 s2 ws4": "moe-ep2-s2-bf16-ws4",
    "stage0 fp32": "s0-fp32-ws2",
    "stage0 bf16": "s0-bf16-ws2",
    "universal": "uc-s2-bf16-ws2",
}
# export_dcp works on every kind (CK402 where the optimizer state is not located): tests/export/test_dcp_kinds.py
WRITE_CAPABILITIES = ("reshard", "export_universal")
# The kinds each writer takes; its own tests hold its outputs against DeepSpeed (reshard of tensor/pipeline-
# parallel checkpoints: tests/export/test_reshard_parallel.py; a ZeRO-3 domain is then CK410, by target; of
# stage-0 ones: tests/export/test_reshard_from_stage0.py; MoE: test_reshard_moe.py, from stage 0
# test_reshard_moe_stage0.py).
MODEL_PARALLEL = {"tp2", "tp2xdp2", "tp2 zero3", "pp2", "pp2xdp2 bf16"}
STAGE0 = {"stage0 fp32", "stage0 bf16", "pp2 stage0 bf16", "pp2 stage0 fp32"}
MOE = {"moe ep2 s0 ws4", "moe ep2 s1 ws4", "moe ep2 s2 ws4"}
# export_universal of an AutoTP ZeRO-3 checkpoint: ds_to_universal's folder (tests/export/test_universal_parallel.py)
SUPPORTED = {
    "reshard": {"zero2 bf16", *MODEL_PARALLEL, *STAGE0, *MOE},
    "export_universal": {"zero2 bf16", *MODEL_PARALLEL, *STAGE0, *MOE},
}


def _target(ds, name: str):
    entry = ds.path(name)
    if name.startswith("uc-"):  # the universal folder ds_to_universal wrote beside the checkpoint
        return entry / info(entry)["universal"]["output_folder"]
    return entry


def _cli(*args: str):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _check_against_live(ds, name: str, weights: dict) -> int:
    """How many masters were compared with the live engine's, bit for bit (every one of them)."""
    import torch

    entry = ds.path(name)
    if name.startswith("uc-"):  # DeepSpeed's own universal files are the oracle
        folder = _target(ds, name) / "zero"
        for param in (p for p in folder.iterdir() if p.is_dir()):
            fp32 = torch.load(param / "fp32.pt", map_location="cpu", weights_only=True)
            fp32 = fp32["param"] if isinstance(fp32, dict) else fp32
            assert bits_equal(weights[param.name].reshape(-1), fp32.reshape(-1)), param.name
        return sum(1 for p in folder.iterdir() if p.is_dir())
    if (entry / "parallel.json").is_file():
        return check_masters(entry, weights)
    live = torch.load(entry / "live_fp32.pt", weights_only=True)
    for key, master in live.items():
        assert bits_equal(weights[key], master.float()), key
    return len(live)


@pytest.mark.parametrize("label", sorted(KINDS))
def test_every_read_command_works(ds, label, tmp_path):
    target = _target(ds, KINDS[label])
    assert _cli("validate", target, "--no-hash").exit_code == 0
    generated = _cli("generate", target, "-o", tmp_path / "doc.json")
    assert generated.exit_code == 0, generated.output
    doc = json.loads((tmp_path / "doc.json").read_text())
    is_index = doc["format"] == "ckptspec.checkpoint"
    assert is_index == (label != "zero2 bf16")
    assert _cli("validate", tmp_path / "doc.json").exit_code == 0
    assert _cli("convert", tmp_path / "doc.json", tmp_path / "doc.msgpack").exit_code == 0
    checked = _cli("validate", tmp_path / "doc.msgpack", "--checkpoint", target)
    assert checked.exit_code == 0, checked.output
    inspected = _cli("inspect", target, "--format", "json")
    assert inspected.exit_code == 0, inspected.output
    diffed = _cli("diff", target, target)
    if label == "universal":  # no ZeRO optimizer files: DeepSpeed loads it only with load_universal
        assert diffed.exit_code == 1 and "CK509" in diffed.output and "no changes" in diffed.output, diffed.output
    else:
        assert diffed.exit_code == 0 and "B can resume" in diffed.output, diffed.output
    rebuilt = _cli("reconstruct", target, tmp_path / "out", "--quiet", "--max-shard-size", "4096", "--untie")
    assert rebuilt.exit_code == 0, rebuilt.output
    from ckptspec.export.api import load_consolidated

    written = load_consolidated(tmp_path / "out")
    weights = ckptspec.load_state_dict(target)
    assert set(written) == set(weights)
    assert all(bits_equal(written[n], weights[n]) for n in weights)


@pytest.mark.parametrize("label", sorted(KINDS))
def test_open_gives_one_view_equal_to_the_live_masters(ds, label, tmp_path):
    target = _target(ds, KINDS[label])
    checkpoint = ckptspec.open(target)
    assert (checkpoint.kind.value == "zero") == (label == "zero2 bf16")
    assert checkpoint.index.domains == checkpoint.domains and checkpoint.domains
    weights = checkpoint.state_dict()
    assert _check_against_live(ds, KINDS[label], weights) > 0
    assert set(checkpoint.names) == set(weights)
    tag_dir = checkpoint.tag_dir
    for name, tensor in checkpoint.tensors.items():
        # The chunks, in order, cover the whole tensor once, and hold its bytes.
        assert [c.start for c in tensor.chunks] == [
            sum(c.numel for c in tensor.chunks[:i]) for i in range(len(tensor.chunks))
        ]
        assert sum(c.numel for c in tensor.chunks) == weights[name].numel()
        if tensor.dtype == "float32":
            data = b"".join((tag_dir / c.file).read_bytes()[c.offset : c.offset + c.nbytes] for c in tensor.chunks)
            assert data == weights[name].contiguous().view(-1).numpy().tobytes(), name
    assert not [f for f in ckptspec.validate_checkpoint(target, verify_hashes=False) if f.severity == "error"]
    described = ckptspec.describe(target)
    assert type(described).__name__ == type(checkpoint.document).__name__


@pytest.mark.parametrize("label", sorted(KINDS))
def test_what_a_kind_cannot_do_is_refused_by_capability(ds, label, tmp_path):
    target = _target(ds, KINDS[label])
    checkpoint = ckptspec.open(target)
    writers = {
        "reshard": lambda out: ckptspec.reshard(target, out, world_size=1),
        "export_universal": lambda out: ckptspec.export_universal(target, out),
    }
    for capability in WRITE_CAPABILITIES:
        assert checkpoint.supports(capability) == (label in SUPPORTED[capability]), capability
        if checkpoint.supports(capability):
            continue
        out = tmp_path / capability
        with pytest.raises(ckptspec.Unsupported) as refused:
            writers[capability](out)
        assert refused.value.code == "CK403" and not out.exists()
        assert checkpoint.kind.label in refused.value.message


def _moments_oracle(ds, name: str) -> dict:
    """DeepSpeed's answer for every parameter's exp_avg and exp_avg_sq, by whole-model name: the live engine's
    state before saving (ZeRO: ``live_optim.pt``), the state DeepSpeed holds after loading the checkpoint
    (stage 0, MoE, the stage-0 pipelines, a universal folder's source tag: ``<name>+optim``), or
    ``ds_to_universal``'s merge of every rank's partitions (tensor/pipeline parallel: ``exp_avg.pt``)."""
    import torch
    from _harness import scenarios

    entry = ds.path(name)
    if (entry / "live_optim.pt").is_file():
        return torch.load(entry / "live_optim.pt", weights_only=True)["state"]
    # (a stage-0 pipeline of PIPE_STAGE0_SPECS: its "+optim" load, made for its reshards)
    loaded = name in scenarios.PIPE_STAGE0_SPECS and name in scenarios.RESHARD_SOURCES
    if name in scenarios.OPTIM_SOURCES or name in scenarios.OPTIM_UNIVERSAL_SOURCES or loaded:
        optim = ds.path(scenarios.optim_name(name))
        prefix = "source" if name in scenarios.OPTIM_UNIVERSAL_SOURCES else "optim"
        merged: dict = {}
        for rank in range(scenarios.REGISTRY[name].world_size):
            merged.update(torch.load(optim / f"{prefix}.rank{rank}.pt", weights_only=True)["state"])
        return merged
    folder = entry / info(entry)["universal"]["output_folder"] / "zero"
    out = {}
    for param in (p for p in folder.iterdir() if (p / "exp_avg.pt").is_file()):
        loaded = {k: torch.load(param / f"{k}.pt", weights_only=True) for k in ("exp_avg", "exp_avg_sq")}
        out[param.name] = {k: v["param"] if isinstance(v, dict) else v for k, v in loaded.items()}
    return out


@pytest.mark.parametrize("label", sorted(KINDS))
def test_the_optimizer_state_of_every_kind_is_deepspeeds(ds, label):
    """``load_optimizer_state`` (what ``reconstruct --optimizer-state`` writes) on every kind: every
    parameter's moments, bit for bit DeepSpeed's own (the kinds' own tests check steps and hyperparameters)."""
    import torch

    oracle = _moments_oracle(ds, KINDS[label])
    state, optimizer = ckptspec.load_optimizer_state(_target(ds, KINDS[label]))
    assert sorted(state) == sorted(oracle) and optimizer["groups"]
    for param, by_key in oracle.items():
        assert set(state[param]) == set(by_key) == {"exp_avg", "exp_avg_sq"}, param
        for key, theirs in by_key.items():
            ours = torch.from_numpy(state[param][key])
            assert bits_equal(ours.reshape(-1), theirs.reshape(-1)) and ours.numel() == theirs.numel(), (param, key)
