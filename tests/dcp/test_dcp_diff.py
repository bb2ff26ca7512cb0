"""``ckptspec diff A B`` of two DCP directories (issue #42), on the real FSDP2 saves: the tensors it says differ are
exactly those whose recorded ``full_tensor()`` differs (step 1 against step 2 of one job; the ws-2 job against the
ws-3 one, whose chunks differ), each digest the sha256 of the job's tensor bytes whatever the sharding."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from _harness.scenarios import dcp_save_name


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _flat(oracle: dict, params: str, state: str) -> dict:
    """The oracle as the save's fqns: model.<name>, optim.state.<param>.<key>."""
    out = {f"model.{n}": t for n, t in oracle[params].items()}
    out.update({f"optim.state.{p}.{k}": t for p, st in oracle[state].items() for k, t in st.items()})
    return out


def _digest(tensor) -> str:
    return "sha256:" + hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize(
    "a, b", [((2, "dcp"), (2, "dcp-step2")), ((2, "dcp"), (3, "dcp")), ((1, "dcp-step2"), (3, "dcp-step2"))]
)
def test_the_changed_tensors_are_the_jobs(a, b, ds):
    import torch

    sides = []
    for world_size, save in (a, b):
        entry = ds.path(dcp_save_name(world_size))
        oracle = torch.load(entry / "oracle.pt", weights_only=True)
        sides.append((entry / save, _flat(oracle, *(("params", "state") if save == "dcp" else ("params2", "state2")))))
    (dir_a, want_a), (dir_b, want_b) = sides
    result = _run("diff", dir_a, dir_b, "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["valid"] is True and "resume" not in doc
    changed = {c["name"]: c for c in doc["changes"]}
    assert {c["kind"] for c in doc["changes"]} <= {"values"}
    differ = {n for n in want_a if not torch.equal(want_a[n], want_b[n])}
    assert set(changed) == differ and differ  # the bytes items (param groups) are the same in both
    for name, change in changed.items():
        assert (change["a"], change["b"]) == (_digest(want_a[name]), _digest(want_b[name])), name
    text = _run("diff", dir_a, dir_b)
    assert text.exit_code == 0 and f"{len(differ)} changes" in text.output


def test_added_removed_bytes_and_refusals(ds, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    source = ds.path(dcp_save_name(2)) / "dcp"
    directory = tmp_path / "dcp"
    shutil.copytree(source, directory)
    metadata = FileSystemReader(str(directory)).read_metadata()
    metadata.state_dict_metadata["optim.param_groups.1.lr"] = metadata.state_dict_metadata.pop(
        "optim.param_groups.1.eps"
    )
    lr = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.1.lr")
    eps = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.1.eps")
    metadata.storage_data[lr] = metadata.storage_data.pop(eps)  # group 1's lr now reads eps's 1e-08
    metadata.storage_meta = None
    import pickle

    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    doc = json.loads(_run("diff", source, directory, "--format", "json").output)
    assert [(c["kind"], c["name"], c["a"], c["b"]) for c in doc["changes"]] == [
        ("values", "optim.param_groups.1.lr", "0.01", "1e-08"),
        ("removed", "optim.param_groups.1.eps", "bytes", None),
    ]
    (directory / "__1_0.distcp").unlink()
    result = _run("diff", source, directory)
    assert result.exit_code == 1 and "CK252 __1_0.distcp is missing" in result.output
    result = _run("diff", source, tmp_path / "elsewhere")
    assert result.exit_code == 2 and "is a torch DCP checkpoint and" in result.output
