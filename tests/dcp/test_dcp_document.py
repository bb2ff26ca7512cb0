"""The DCP document (``ckptspec.dcp`` 1.0, docs/spec-dcp.md) of the real FSDP2 saves (issue #42): ``ckptspec generate
DCP_DIR`` describes what torch saved and ``validate DOC --checkpoint DCP_DIR`` refuses a document of another save.

tests/_harness/dcp_save_job.py trains the tiny model with FSDP2 (CPU, gloo) and AdamW at world size 1, 2 and 3 and
saves twice (``dcp``, then ``dcp-step2`` after one more step). For each save the document's tensors, chunks, storage
items and bytes items are exactly those of torch's own ``FileSystemReader.read_metadata()`` (read by torch here, never
by ckptspec), its world size the job's, and every tensor read through the document alone (numpy at each chunk's
``data_offset``, no ckptspec code) equals the job's ``full_tensor()`` bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name

ROOT = Path(__file__).resolve().parents[2]
NUMPY = {"float32": np.float32, "int64": np.int64, "float64": np.float64, "int32": np.int32}


def _run(*args):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _generate(directory, out, *extra) -> dict:
    result = _run("generate", directory, "-o", out, *extra)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def _codes(result) -> set[str]:
    return {f["code"] for f in json.loads(result.stdout)["findings"]}


def _read_through_document(doc: dict, directory) -> dict[str, np.ndarray]:
    """Every tensor of the document from its chunks' bytes: what any reader of the document does."""
    out = {}
    for t in doc["tensors"]:
        whole = np.zeros(t["shape"], NUMPY[t["dtype"]])
        for c in t["chunks"]:
            count = int(np.prod(c["sizes"]))
            with open(directory / c["file"], "rb") as fh:
                fh.seek(c["data_offset"])
                data = np.frombuffer(fh.read(count * whole.itemsize), whole.dtype).reshape(c["sizes"])
            whole[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))] = data
        out[t["name"]] = whole
    return out


def _torch_view(directory) -> tuple[dict, dict, list]:
    """torch's own reading of ``.metadata``: tensors (dtype, size, chunks with their storage), bytes items."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = FileSystemReader(str(directory)).read_metadata()
    tensors, items = {}, []
    for fqn, entry in meta.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            info = meta.storage_data[MetadataIndex(fqn)]
            items.append({"name": fqn, "file": info.relative_path, "offset": info.offset, "length": info.length})
            continue
        chunks = []
        for chunk in entry.chunks:
            info = meta.storage_data[MetadataIndex(fqn, chunk.offsets)]
            chunks.append((list(chunk.offsets), list(chunk.sizes), info.relative_path, info.offset, info.length))
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        tensors[fqn] = (dtype, list(entry.size), chunks)
    return tensors, {i["name"]: i for i in items}, sorted({i.relative_path for i in meta.storage_data.values()})


@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_the_document_is_what_torch_saved(world_size, save, ds, tmp_path):
    import torch

    entry = ds.path(dcp_save_name(world_size))
    directory = entry / save
    doc = _generate(directory, tmp_path / "doc.json", "--hash")
    assert _run("validate", tmp_path / "doc.json").exit_code == 0
    checked = _run("validate", tmp_path / "doc.json", "--checkpoint", directory)
    assert checked.exit_code == 0, checked.output

    tensors, items, files = _torch_view(directory)
    assert doc["world_size"] == world_size
    assert [f["path"] for f in doc["files"]] == files
    assert {f["path"]: f["size"] for f in doc["files"]} == {n: (directory / n).stat().st_size for n in files}
    assert {t["name"] for t in doc["tensors"]} == set(tensors)
    for t in doc["tensors"]:
        dtype, size, chunks = tensors[t["name"]]
        assert (t["dtype"], t["shape"]) == (dtype, size), t["name"]
        described = [(c["offsets"], c["sizes"], c["file"], c["offset"], c["length"]) for c in t["chunks"]]
        assert described == chunks, t["name"]
    assert {b["name"]: b for b in doc["bytes"]} == items and len(items) == 24

    read = _read_through_document(doc, directory)
    oracle = torch.load(entry / "oracle.pt", weights_only=True)
    params, state = (oracle["params"], oracle["state"]) if save == "dcp" else (oracle["params2"], oracle["state2"])
    compared = 0
    for name, tensor in params.items():
        assert np.array_equal(read[f"model.{name}"], tensor.numpy()), name
        compared += 1
    for name, moments in state.items():
        for key, tensor in moments.items():
            got = read[f"optim.state.{name}.{key}"]
            assert got.dtype == tensor.numpy().dtype and np.array_equal(got, tensor.numpy()), (name, key)
            compared += 1
    assert compared == len(params) + 3 * len(state) > 20
    if save == "dcp":  # the buffers too: the job's dcp_to_torch_save of this save
        flat = torch.load(entry / "torch_save.pt", weights_only=True)["model"]
        for name, tensor in flat.items():
            assert np.array_equal(read[f"model.{name}"], tensor.numpy()), name


def test_a_document_of_another_save_is_refused(ds, tmp_path):
    """Stale: the same directory saved again (step 2), a save of another world size, a cut file, a file of
    another save of the same layout (which torch loads silently and ``validate DCP_DIR`` alone cannot tell)."""
    entry = ds.path(dcp_save_name(2))
    doc = tmp_path / "doc.json"
    _generate(entry / "dcp", doc, "--hash")

    again = _run("validate", doc, "--checkpoint", entry / "dcp-step2", "--format", "json")
    assert again.exit_code == 1 and {"CK256", "CK257"} <= _codes(again), again.output

    other = _run("validate", doc, "--checkpoint", ds.path(dcp_save_name(3)) / "dcp", "--format", "json", "--no-hash")
    assert other.exit_code == 1 and {"CK255", "CK256"} <= _codes(other), other.output

    cut = tmp_path / "cut"
    shutil.copytree(entry / "dcp", cut)
    data = (cut / "__1_0.distcp").read_bytes()
    (cut / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    result = _run("validate", doc, "--checkpoint", cut, "--format", "json", "--no-hash")
    assert result.exit_code == 1 and {"CK253", "CK256"} <= _codes(result), result.output

    swapped = tmp_path / "swapped"
    shutil.copytree(entry / "dcp", swapped)
    shutil.copy(entry / "dcp-step2" / "__0_0.distcp", swapped / "__0_0.distcp")
    assert (swapped / "__0_0.distcp").stat().st_size == (entry / "dcp" / "__0_0.distcp").stat().st_size
    assert _run("validate", swapped).exit_code == 0  # the directory agrees with its .metadata
    result = _run("validate", doc, "--checkpoint", swapped, "--format", "json")
    assert result.exit_code == 1 and _codes(result) == {"CK256", "CK257"}, result.output
    findings = json.loads(result.stdout)["findings"]
    assert {f["file"] for f in findings} == {"__0_0.distcp"}

    (swapped / "__1_0.distcp").unlink()
    result = _run("validate", doc, "--checkpoint", swapped, "--format", "json", "--no-hash")
    assert result.exit_code == 1 and {"CK252", "CK256"} <= _codes(result), result.output


def test_generate_refuses_a_checkpoint_with_errors_and_writes_nothing(ds, tmp_path):
    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    data = (directory / "__0_0.distcp").read_bytes()
    (directory / "__0_0.distcp").write_bytes(data[:-100])
    out = tmp_path / "doc.json"
    out.write_text("before")
    result = _run("generate", directory, "-o", out)
    assert result.exit_code == 1, result.output
    assert "CK253" in result.output and "nothing was written" in result.output
    assert out.read_text() == "before"
    assert _run("generate", directory, "--tag", "x").exit_code == 2


def test_a_document_is_checked_against_a_dcp_directory_only(ds, tmp_path):
    doc = tmp_path / "doc.json"
    _generate(ds.path(dcp_save_name(1)) / "dcp", doc)
    result = _run("validate", doc, "--checkpoint", tmp_path)
    assert result.exit_code == 2 and "local DCP directory" in result.output
    assert _run("validate", doc, "--checkpoint", ds.path(dcp_save_name(1)) / "dcp", "--tag", "t").exit_code == 2
    inspected = _run("inspect", doc)
    assert inspected.exit_code == 1 and "CK202" in inspected.output, inspected.output


def test_reconstruct_through_the_document(ds, tmp_path):
    """``reconstruct DCP_DIR OUT --manifest DOC``: the directory checked against the document first; the weights are
    the job's ``full_tensor()``; a document of the other save writes nothing."""
    import torch
    from safetensors.torch import load_file

    entry = ds.path(dcp_save_name(3))
    doc = tmp_path / "doc.json"
    _generate(entry / "dcp", doc, "--hash")
    result = _run("reconstruct", entry / "dcp", tmp_path / "out", "--manifest", doc)
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    oracle = torch.load(entry / "oracle.pt", weights_only=True)["params"]
    assert set(oracle) <= set(got)
    for name, tensor in oracle.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    stale = _run("reconstruct", entry / "dcp-step2", tmp_path / "stale", "--manifest", doc)
    assert stale.exit_code == 1 and "CK256" in stale.output and "CK257" in stale.output, stale.output
    assert "nothing was written" in stale.output and not (tmp_path / "stale").exists()
    manifest = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
    assert _run("reconstruct", entry / "dcp", tmp_path / "x", "--manifest", manifest).exit_code == 2


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.sentinel}",)


def test_a_forged_metadata_is_refused_with_its_document(ds, tmp_path):
    """The document does not vouch for a forged ``.metadata``: it is read as ``validate DCP_DIR`` reads it (CK204,
    nothing run) before anything is compared, and ``generate`` describes nothing."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    directory = tmp_path / "dcp"
    shutil.copytree(ds.path(dcp_save_name(2)) / "dcp", directory)
    doc = tmp_path / "doc.json"
    _generate(directory, doc)
    metadata = FileSystemReader(str(directory)).read_metadata()
    metadata.storage_meta, metadata.version = None, _Payload(tmp_path / "ran")
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    result = _run("validate", doc, "--checkpoint", directory, "--format", "json")
    assert result.exit_code == 1 and json.loads(result.stdout)["error"]["code"] == "CK204", result.output
    result = _run("generate", directory, "-o", tmp_path / "again.json")
    assert result.exit_code == 1 and "CK204" in result.output, result.output
    assert not (tmp_path / "ran").exists() and not (tmp_path / "again.json").exists()


def test_an_edited_document_is_refused_where_it_differs(ds, tmp_path):
    """A valid document (its rules pass) that says another place than the save: a chunk's elements two elements on
    inside their record, a bytes item renamed: CK255 at exactly those paths."""
    directory = ds.path(dcp_save_name(2)) / "dcp"
    doc = _generate(directory, tmp_path / "doc.json")
    doc["tensors"][2]["chunks"][1]["data_offset"] += 8
    doc["bytes"][3]["name"] = "optim.param_groups.0.renamed"
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    assert _run("validate", tmp_path / "edited.json").exit_code == 0
    result = _run("validate", tmp_path / "edited.json", "--checkpoint", directory, "--format", "json", "--no-hash")
    assert result.exit_code == 1, result.output
    found = {(f["code"], f["path"]) for f in json.loads(result.stdout)["findings"]}
    assert found == {
        ("CK255", "$.tensors[2].chunks[1].data_offset"),
        ("CK255", "$.bytes[3]"),
        ("CK255", "$.bytes"),  # .metadata's item the document no longer names
    }
