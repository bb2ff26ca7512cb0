"""Issue #16: the outputs of a tensor/pipeline-parallel reconstruction besides model.safetensors, written
by the 1.x writers from the whole-model plan (export/compose_plan.py): ``--format torch``,
``--max-shard-size``, ``--untie`` and ``--optimizer-state``. Held against DeepSpeed's own answers:
the live masters every rank gathered in the job, and ``ds_to_universal``'s ``exp_avg.pt`` /
``exp_avg_sq.pt`` / ``fp32.pt`` (full logical shape, DeepSpeed's merge of every rank's partitions).
"""

import json

import pytest
from _harness.parallel_oracles import bits_equal, check_masters, info
from click.testing import CliRunner

from ckptspec.cli import cli

MP = [
    "pp2-s1-fp32-ws2",
    "pp2-s1-bf16-ws2",
    "pp2dp2-s1-fp32-ws4",
    "pp2dp2-s1-bf16-ws4",
    "tp2-s1-fp32-ws2",
    "tp2dp2-s2-bf16-ws4",
    "tp2-s3-bf16-ws2",
]


def _reconstruct(entry, out, *flags):
    result = CliRunner().invoke(cli, ["reconstruct", str(entry), str(out), "--quiet", *flags])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    return out


def _universal(entry, name, key, shape):
    import torch

    folder = entry / info(entry)["universal"]["output_folder"] / "zero" / name
    value = torch.load(folder / f"{key}.pt", map_location="cpu", weights_only=True)
    value = value["param"] if isinstance(value, dict) else value
    return value.reshape(shape)


@pytest.mark.parametrize("name", MP)
def test_optimizer_state_is_deepspeeds_universal_moments(ds, name, tmp_path):
    """Every whole parameter's exp_avg and exp_avg_sq equal, bit for bit, what ds_to_universal merged
    from every rank's partitions; the masters beside them are its fp32.pt; the step is each rank's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    entry = ds.path(name)
    out = _reconstruct(entry, tmp_path / "out", "--optimizer-state")
    weights, state = load_file(out / "model.safetensors"), load_file(out / "optimizer.safetensors")
    assert sorted(state) == sorted(f"{p}.{k}" for p in weights for k in ("exp_avg", "exp_avg_sq"))
    for key, tensor in state.items():
        param, moment = key.rsplit(".", 1)
        assert bits_equal(tensor, _universal(entry, param, moment, tensor.shape)), key
    for param, tensor in weights.items():
        assert bits_equal(tensor, _universal(entry, param, "fp32", tensor.shape)), param
    with safe_open(out / "optimizer.safetensors", "pt") as fh:
        meta = fh.metadata()
    optimizer = json.loads(meta["ckptspec.optimizer"])
    assert [g["step"] for g in optimizer["groups"]] == [info(entry)["spec"]["steps"]]
    assert optimizer["groups"][0]["hyperparameters"]["lr"] == 0.01  # the job's torch.optim.Adam
    assert json.loads(meta["ckptspec.states"])[next(iter(weights))] == {
        "exp_avg": f"{next(iter(weights))}.exp_avg",
        "exp_avg_sq": f"{next(iter(weights))}.exp_avg_sq",
    }


@pytest.mark.parametrize("name", ["pp2dp2-s1-fp32-ws4", "tp2dp2-s2-bf16-ws4", "tp2-s3-bf16-ws2"])
def test_torch_format_sharding_and_untie_write_the_same_tensors(ds, name, tmp_path):
    """--format torch (torch.load with weights_only), --max-shard-size and --untie hold exactly the tensors
    of model.safetensors, which are the live engine's masters."""
    import torch
    from safetensors.torch import load_file

    entry = ds.path(name)
    single = load_file(_reconstruct(entry, tmp_path / "single") / "model.safetensors")
    assert check_masters(entry, single) >= len(single)
    torch_out = _reconstruct(entry, tmp_path / "torch", "--format", "torch")
    index = json.loads((torch_out / "pytorch_model.bin.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(single)
    loaded = torch.load(torch_out / "pytorch_model.bin", weights_only=True)
    assert list(loaded) == list(single) and all(bits_equal(loaded[n], single[n]) for n in single)
    sharded = _reconstruct(entry, tmp_path / "sharded", "--max-shard-size", "1K", "--untie")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and sorted(weight_map) == sorted(single)
    parts = {}
    for shard in sorted(set(weight_map.values())):
        parts.update(load_file(sharded / shard))
    assert all(bits_equal(parts[n], single[n]) for n in single)


def test_the_api_writes_the_same_outputs(ds, tmp_path):
    import torch
    from safetensors.torch import load_file

    from ckptspec.export.api import reconstruct

    entry = ds.path("tp2-s1-fp32-ws2")
    cli_out = _reconstruct(entry, tmp_path / "cli", "--optimizer-state")
    result = reconstruct(entry, tmp_path / "api", fmt="torch", optimizer_state=True)
    assert sorted(result.files) == ["optimizer.safetensors", "pytorch_model.bin"]
    weights = torch.load(tmp_path / "api" / "pytorch_model.bin", weights_only=True)
    expected = load_file(cli_out / "model.safetensors")
    assert all(bits_equal(weights[n], expected[n]) for n in expected)
    assert (tmp_path / "api" / "optimizer.safetensors").read_bytes() == (cli_out / "optimizer.safetensors").read_bytes()


def test_load_optimizer_state_of_an_index(ds, tmp_path):
    """ckptspec.load_optimizer_state gives the whole model's moments, as optimizer.safetensors holds them."""
    from safetensors.numpy import load_file

    import ckptspec

    entry = ds.path("tp2dp2-s2-bf16-ws4")
    states, optimizer = ckptspec.load_optimizer_state(entry)
    written = load_file(_reconstruct(entry, tmp_path / "out", "--optimizer-state") / "optimizer.safetensors")
    assert sorted(f"{p}.{k}" for p, keys in states.items() for k in keys) == sorted(written)
    for param, keys in states.items():
        for key, array in keys.items():
            assert (
                array.tobytes() == written[f"{param}.{key}"].tobytes()
                and array.shape == written[f"{param}.{key}"].shape
            )
    assert [g["step"] for g in optimizer["groups"]] == [2]
