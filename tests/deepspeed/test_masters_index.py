"""Issue #17: ZeRO stage-0, native MoE and universal checkpoints generated, validated and reconstructed
through the checkpoint index, against the real checkpoints of the harness (PARALLEL) and the oracles
their jobs recorded: the live engine's fp32 masters on every rank (``oracle.rank*.pt``: every
expert from the rank that owns it) and, for universal folders, DeepSpeed's own ``fp32.pt`` tensors
(read with torch here, the oracle)."""

import json

import pytest
from _harness import scenarios
from click.testing import CliRunner

from ckptspec.cli import cli

pytestmark = pytest.mark.deepspeed

STAGE0 = sorted(n for n in scenarios.PARALLEL if n.startswith(("s0-", "moe-ep2-s0-")) and not n.endswith("ws1"))
MOE_ZERO = sorted(n for n in scenarios.PARALLEL if n.startswith(("moe-ep2-s1-", "moe-ep2-s2-")))
UNIVERSAL = ["uc-s2-bf16-ws2", "uc-s3-bf16-ws2"]
PIPELINE_S0 = ["pp2-s0-bf16-ws2"]  # BF16_Optimizer: masters partitioned like stage 1, param_shapes None
ALL = STAGE0 + MOE_ZERO + PIPELINE_S0


def _cli(*args):
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


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
    the live engine held (and, for a universal folder, DeepSpeed's fp32.pt)."""
    from safetensors.torch import load_file

    folder = _folder(ds, name)
    doc = tmp_path / "index.json"
    result = _cli("generate", str(folder), "-o", str(doc))
    assert result.exit_code == 0, result.stderr
    index = json.loads(doc.read_text())
    assert index["format"] == "ckptspec.checkpoint"
    assert index["kind"] == ("universal" if name in UNIVERSAL else "zero")
    assert all("masters" in d for d in index["domains"])
    result = _cli("validate", str(doc), "--checkpoint", str(folder))
    assert result.exit_code == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    result = _cli("reconstruct", str(folder), str(out), "--quiet")
    assert result.exit_code == 0, result.stderr
    got = load_file(out / "model.safetensors")
    live = _live_masters(ds, name)
    assert sorted(got) == sorted(live)
    assert sorted(n for n in live if not _bits_equal(got[n], live[n])) == [], name
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


@pytest.mark.parametrize("name", ["s0-bf16-ws2", "moe-ep2-s0-bf16-ws4", "moe-ep2-s2-fp32-ws4", "uc-s3-bf16-ws2"])
def test_load_state_dict_in_fp32_and_bf16(ds, name):
    import torch

    from ckptspec import load_state_dict

    live = _fp32_pt(ds, name) if name in UNIVERSAL else _live_masters(ds, name)
    fp32 = load_state_dict(_folder(ds, name))
    assert sorted(fp32) == sorted(live) and all(_bits_equal(fp32[n], live[n]) for n in live)
    bf16 = load_state_dict(_folder(ds, name), dtype="bf16")
    assert all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], live[n].to(torch.bfloat16)) for n in live)


def test_inspect_shows_domains_masters_and_expert_files(ds):
    result = _cli("inspect", str(_folder(ds, "moe-ep2-s0-bf16-ws4")), "--format", "json")
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
    stage2 = json.loads(_cli("inspect", str(_folder(ds, "moe-ep2-s2-fp32-ws4")), "--format", "json").stdout)
    # partition_count [4, 2]: the dense group over 4 ranks, each expert group over its 2 expert-data ranks
    assert [(d["size"], d["zero_stage"]) for d in stage2["domains"]] == [(4, 2), (2, 2), (2, 2)]
    text = _cli("inspect", str(_folder(ds, "uc-s2-bf16-ws2")))
    assert text.exit_code == 0 and "(universal)" in text.stdout and "masters in universal" in text.stdout


def test_diff(ds):
    """The same checkpoint: nothing differs and B can resume; a stage-0 MoE against a stage-2 one: the
    stages differ (DeepSpeed cannot load one's optimizer state into the other)."""
    same = _cli(
        "diff", str(_folder(ds, "moe-ep2-s1-fp32-ws2")), str(_folder(ds, "moe-ep2-s1-fp32-ws2")), "--format", "json"
    )
    assert same.exit_code == 0 and json.loads(same.stdout)["resume"]["ok"], same.stdout + same.stderr
    other = _cli("diff", str(_folder(ds, "s0-fp32-ws2")), str(_folder(ds, "moe-ep2-s0-fp32-ws2")), "--format", "json")
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
    result = _cli(*args)
    assert result.exit_code == 1, result.output
    assert "CK202" in result.stderr and "blocks.0.up.weight" in result.stderr
    assert not out.exists()
