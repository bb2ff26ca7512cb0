"""A Megatron-core ``torch_dist`` checkpoint (issue #42, item 3): ``validate``, ``inspect``, ``reconstruct`` and
``load_state_dict`` against what Megatron-core's own ``dist_checkpointing.load`` returned, bit for bit.

The checkpoint is the committed copy a real Megatron-core 0.16.1 job wrote (``tests/_harness/megatron_job.py``, 2
ranks under torchrun, CPU, gloo; ``scripts/megatron.sh`` runs it in ``.venv-megatron`` and refreshes the copy):
``checkpoint/`` as Megatron saved it, ``loaded.pt`` what its load of the whole tensors returned, ``job.json`` the
versions and the job script's sha256 (a changed job without a refreshed copy fails here). ``./scripts/megatron.sh
--check`` runs the job again and these tests on its output (``CKPTSPEC_MEGATRON_DATA``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

DATA = Path(
    os.environ.get("CKPTSPEC_MEGATRON_DATA") or Path(__file__).resolve().parents[1] / "data" / "megatron-core-0.16.1"
)
JOB = Path(__file__).resolve().parents[1] / "_harness" / "megatron_job.py"


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def loaded():
    import torch

    return torch.load(DATA / "loaded.pt", weights_only=True)


def _tensors(loaded, model: bool):
    import torch

    return {
        k: v for k, v in loaded.items() if torch.is_tensor(v) and k.startswith("optimizer.") is not model
    }  # fmt: skip


def test_the_committed_copy_is_the_current_jobs():
    job = json.loads((DATA / "job.json").read_text())
    assert job["script_sha256"] == hashlib.sha256(JOB.read_bytes()).hexdigest(), (
        "tests/_harness/megatron_job.py changed since the committed copy was made: run ./scripts/megatron.sh"
    )
    assert (job["megatron_core"], job["world_size"]) == ("0.16.1", 2)
    assert sorted(os.listdir(DATA / "checkpoint")) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", "common.pt", "metadata.json"
    ]  # fmt: skip


def test_validate_reads_metadata_json_and_common_pt():
    directory = DATA / "checkpoint"
    result = _run("validate", directory)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"{directory}: Megatron-core torch_dist: metadata.json and common.pt read, nothing run",
        f"{directory}: 2 bytes entries (pickles, read by the restricted reader, nothing run): "
        "rng_state/shard_0_2, rng_state/shard_1_2",
        f"{directory}: valid",
    ]


def test_inspect_gives_megatrons_config_and_common_state(loaded):
    result = _run("inspect", DATA / "checkpoint", "--format", "json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["kind"] == "megatron-torch_dist"
    assert summary["megatron"]["config"] == json.loads((DATA / "checkpoint" / "metadata.json").read_text())
    # The common state as Megatron's load returned it (plain values; it holds no tensor).
    common = {k: v for k, v in loaded.items() if k not in _tensors(loaded, True) | _tensors(loaded, False)}
    common.pop("rng_state")  # a ShardedObject: a bytes entry of the DCP part, not common.pt
    assert summary["megatron"]["common"] == common
    shapes = {t["name"]: t["shape"] for t in summary["largest"]}
    assert shapes == {k: list(v.shape) for k, v in {**_tensors(loaded, True), **_tensors(loaded, False)}.items()}


def test_reconstruct_equals_megatrons_load_bit_for_bit(loaded, tmp_path):
    from safetensors.torch import load_file

    result = _run("reconstruct", DATA / "checkpoint", tmp_path / "out")
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = _tensors(loaded, True)
    assert (
        sorted(got)
        == sorted(want)
        == [
            "decoder.final_layernorm.weight",
            "decoder.layers.mlp.linear_fc2.weight",
            "decoder.layers.self_attention.linear_qkv.weight",
            "embedding.word_embeddings.weight",
            "output_layer.weight",
        ]
    )  # Megatron's keys as torch_dist stores them: a model's layers stacked on a leading axis, no optimizer.*
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].view(-1).view(torch_uint(tensor)).equal(tensor.view(-1).view(torch_uint(tensor))), name


def torch_uint(tensor):
    import torch

    return {2: torch.int16, 4: torch.int32}[tensor.element_size()]  # bits, not values: -0.0 and NaN compared too


def test_load_state_dict_equals_megatrons_load(loaded):
    import torch

    import ckptspec

    got = ckptspec.load_state_dict(DATA / "checkpoint")  # in fp32 (its default): the bf16 embedding widened
    want = {k: v.to(torch.float32) for k, v in _tensors(loaded, True).items()}
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.float32 and got[k].equal(want[k]) for k in want)


def test_optimizer_state_is_refused_by_name(tmp_path):
    result = _run("reconstruct", DATA / "checkpoint", tmp_path / "out", "--optimizer-state")
    assert result.exit_code == 1, result.output
    assert "CK402" in result.output and "Megatron-core torch_dist" in result.output
    assert not (tmp_path / "out").exists()


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _copy(tmp_path) -> Path:
    directory = tmp_path / "checkpoint"
    shutil.copytree(DATA / "checkpoint", directory)
    return directory


def test_a_forged_common_pt_is_refused_and_never_run(tmp_path):
    import pickle

    import torch

    directory = _copy(tmp_path)
    torch.save({"iteration": 7, "args": _Payload(tmp_path / "ran")}, directory / "common.pt")
    for command in ("validate", "inspect", "reconstruct"):
        args = [command, directory, "--format", "json"] if command != "reconstruct" else [command, directory, tmp_path]
        result = _run(*args)
        assert result.exit_code == 1, (command, result.output)
        assert "CK204" in result.output and "posix.system" in result.output, (command, result.output)
    text = _run("validate", directory).output
    assert text.startswith(f"{directory / 'common.pt'}: CK204 data.pkl references global posix.system"), text
    assert not (tmp_path / "ran").exists()
    # What Megatron's own load does with it (TorchCommonLoadStrategy: torch.load(path, map_location="cpu")): torch's
    # weights_only default refuses it too; with weights_only=False (older torch, or a user's setting) it would run.
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        torch.load(directory / "common.pt", map_location="cpu")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("config", "code", "message"),
    [
        ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', "CK202", "Megatron sharded backend 'zarr'"),
        ("{not json", "CK205", "metadata.json is not JSON"),
        ('["torch_dist"]', "CK205", "metadata.json holds a list"),
        (" " * (64 * 1024 + 1), "CK205", "metadata.json holds over 65536 bytes"),
    ],
)
def test_a_bad_metadata_json_is_refused(tmp_path, config, code, message):
    directory = _copy(tmp_path)
    (directory / "metadata.json").write_text(config)
    error = json.loads(_run("validate", directory, "--format", "json").output)["error"]
    assert error["code"] == code and message in error["message"], error


def test_a_missing_common_pt_is_a_finding(tmp_path):
    directory = _copy(tmp_path)
    (directory / "common.pt").unlink()
    report = json.loads(_run("validate", directory, "--format", "json").output)
    assert report["valid"] is False
    assert [(f["code"], f["message"]) for f in report["findings"]] == [
        ("CK252", "common.pt is missing (Megatron's common state)")
    ]


def test_an_args_namespace_in_common_pt_is_refused_by_name(tmp_path):
    """Megatron-LM's training loop saves its ``args`` (an ``argparse.Namespace``) in the common state: not on the
    restricted reader's allowlist (nor on torch.load's weights_only one), so refused by name, not read."""
    import argparse
    import pickle

    import torch

    directory = _copy(tmp_path)
    torch.save({"iteration": 7, "args": argparse.Namespace(lr=0.01)}, directory / "common.pt")
    text = _run("validate", directory).output
    assert text.startswith(f"{directory / 'common.pt'}: CK204 data.pkl references global argparse.Namespace"), text
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(directory / "common.pt", map_location="cpu")  # Megatron's own call, without add_safe_globals


def test_diff_compares_the_common_states_key_by_key(tmp_path):
    import torch

    directory = _copy(tmp_path)
    assert _run("diff", DATA / "checkpoint", directory, "--format", "json").output.count('"changes": []') == 1
    torch.save({"iteration": 9, "checkpoint_version": 3.0, "extra": torch.zeros(2)}, directory / "common.pt")
    result = _run("diff", DATA / "checkpoint", directory, "--format", "json")
    assert result.exit_code == 0, result.output
    scheduler = {"max_lr": 3e-4, "num_steps": 7, "decay_style": "cosine"}
    assert [(c["kind"], c["name"], c["a"], c["b"], c["role"]) for c in json.loads(result.output)["changes"]] == [
        ("values", "iteration", 7, 9, "common"),
        ("added", "extra", None, {"tensor": "float32", "shape": [2]}, "common"),
        ("removed", "opt_param_scheduler", scheduler, None, "common"),
    ]  # the sharded tensors and bytes items are the same: no other row
    text = _run("diff", DATA / "checkpoint", directory).output
    assert text.startswith(f"A: {DATA / 'checkpoint'} (Megatron-core torch_dist)\n"), text


def test_another_tools_metadata_json_leaves_a_plain_dcp_save(tmp_path):
    directory = _copy(tmp_path)
    (directory / "metadata.json").write_text('{"format": "another tool", "step": 7}')
    (directory / "common.pt").unlink()  # not Megatron's: not looked for
    result = _run("inspect", directory, "--format", "json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["kind"] == "dcp" and "megatron" not in summary
