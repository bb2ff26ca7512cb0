"""The checks of a DCP checkpoint's files (CK250-CK254, issue #42), each against a real mutation of a real save,
beside what torch's own ``dcp_to_torch_save`` does with the same directory (measured in a process of its own).

The saves are tests/_harness/dcp_save_job.py's (FSDP2, gloo): ``dcpsave-ws2`` unless the fault says otherwise.
Each fault copies the save, mutates the copy (cuts, deletes, swaps or replaces a ``.distcp``; or re-pickles an
edited ``.metadata``), runs ``check_dcp`` (the codes asserted exactly), then torch: ``raises`` (the exception's
type), ``loads wrong`` (the output differs from the saving job's ``full_tensor()`` oracles), ``loads right``.
docs/validation.md's table is this one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _harness.scenarios import dcp_save_name

from ckptspec.checkpoint.dcp.checks import bytes_entries, check_dcp


def _cut(d: Path, entry: Path) -> None:
    f = d / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _missing(d: Path, entry: Path) -> None:
    (d / "__1_0.distcp").unlink()


def _swapped(d: Path, entry: Path) -> None:
    (d / "__0_0.distcp").rename(d / "tmp")
    (d / "__1_0.distcp").rename(d / "__0_0.distcp")
    (d / "tmp").rename(d / "__1_0.distcp")


def _other_save_same_layout(d: Path, entry: Path) -> None:
    shutil.copy(entry / "dcp-step2" / "__1_0.distcp", d / "__1_0.distcp")


def _other_save_other_layout(d: Path, entry: Path) -> None:
    shutil.copy(entry.with_name(OTHER_LAYOUT.read_text()) / "dcp" / "__1_0.distcp", d / "__1_0.distcp")


def _edit_metadata(d: Path, edit) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(d)).read_metadata()
    metadata.storage_meta = None
    edit(metadata)
    (d / ".metadata").write_bytes(pickle.dumps(metadata))


def _gap(d: Path, entry: Path) -> None:
    """The last chunk of l1.weight dropped, with its storage item: the save's metadata says less than it wrote."""

    def edit(m):
        chunk = m.state_dict_metadata["model.l1.weight"].chunks.pop()
        for key in [
            k for k in m.storage_data if k.fqn == "model.l1.weight" and tuple(k.offset) == tuple(chunk.offsets)
        ]:
            del m.storage_data[key]

    _edit_metadata(d, edit)


def _overlap(d: Path, entry: Path) -> None:
    """l1.weight's second chunk moved onto its first, its storage item's key with it."""
    import torch

    def edit(m):
        chunks = m.state_dict_metadata["model.l1.weight"].chunks
        second = chunks[1].offsets
        chunks[1].offsets = torch.Size(chunks[0].offsets)
        for key in [k for k in m.storage_data if k.fqn == "model.l1.weight" and tuple(k.offset) == tuple(second)]:
            info = m.storage_data.pop(key)
            m.storage_data[type(key)(key.fqn, torch.Size(chunks[0].offsets), key.index)] = info
            break

    _edit_metadata(d, edit)


def _item_elsewhere(d: Path, entry: Path) -> None:
    """l1.weight's first item points at l1.bias's bytes (a forged offset inside the same file)."""

    def edit(m):
        keys = {k.fqn: k for k in m.storage_data if tuple(k.offset or ()) in ((0, 0), (0,))}
        m.storage_data[keys["model.l1.weight"]] = m.storage_data[keys["model.l1.bias"]]

    _edit_metadata(d, edit)


def _item_dropped(d: Path, entry: Path) -> None:
    """The storage item of l2.bias's first chunk dropped: the chunk stays in state_dict_metadata."""

    def edit(m):
        del m.storage_data[next(k for k in m.storage_data if k.fqn == "model.l2.bias" and tuple(k.offset) == (0,))]

    _edit_metadata(d, edit)


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _bytes_item_payload(d: Path, entry: Path) -> None:
    """A bytes item (param group 0's ``lr``) pointed at a torch.save record of an ``os.system`` payload appended to
    rank 0's file: a ``.metadata`` of DCP's own classes only, every item inside its file."""
    import io

    import torch

    record = io.BytesIO()
    torch.save(_Payload(d.parent / "payload-ran"), record)
    f = d / "__0_0.distcp"
    start = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(record.getvalue())

    def edit(m):
        key = next(k for k in m.storage_data if k.fqn == "optim.param_groups.0.lr")
        info = m.storage_data[key]
        m.storage_data[key] = type(info)(f.name, start, len(record.getvalue()))

    _edit_metadata(d, edit)


@dataclass(frozen=True)
class Fault:
    mutate: object
    codes: list  # check_dcp's codes, in order (the files' named in ``files``)
    files: list
    torch: str  # what dcp_to_torch_save did, measured: "raises <Type>", "loads wrong", "loads right"
    says: str = ""  # in the first finding's message


_R0, _R1 = "__0_0.distcp", "__1_0.distcp"
FAULTS = {
    "truncated": Fault(_cut, ["CK253"], ["__1_0.distcp"], "raises RuntimeError"),
    "missing": Fault(_missing, ["CK252"], ["__1_0.distcp"], "raises FileNotFoundError"),
    "swapped": Fault(_swapped, ["CK253", "CK254", "CK254", "CK254"], [_R1, _R0, _R1, _R1], "raises AttributeError"),
    "other-save-same-layout": Fault(_other_save_same_layout, [], [], "loads wrong"),
    "other-save-other-layout": Fault(
        _other_save_other_layout, ["CK253", "CK254", "CK254"], [_R1, _R1, _R1], "raises UnpicklingError"
    ),
    "metadata-gap": Fault(_gap, ["CK250"], [None], "loads wrong"),
    "metadata-overlap": Fault(_overlap, ["CK250"], [None], "raises AssertionError"),
    "bytes-item-payload": Fault(
        _bytes_item_payload,
        ["CK204"],
        [_R0],
        "loads right, runs the payload",
        "bytes item optim.param_groups.0.lr references global posix.system, which is not allowlisted",
    ),
    "metadata-item-dropped": Fault(_item_dropped, ["CK251"], [None], "raises KeyError"),
    "metadata-item-elsewhere": Fault(_item_elsewhere, ["CK254"], [_R0], "raises IndexError"),
}


def _validate(directory: Path, output: str):
    from click.testing import CliRunner

    from ckptspec.cli import cli

    return CliRunner().invoke(cli, ["validate", str(directory), "--format", output])


MEASURE = Path(__file__).with_name("dcp_torch_load.py")


@pytest.fixture(scope="module")
def torch_outcomes(ds, tmp_path_factory) -> dict[str, tuple[dict, bool]]:
    """Per fault: what torch's dcp_to_torch_save did with a copy mutated the same way (one process for every fault:
    torch is imported once), and whether the payload ran. The copies are not the ones ckptspec checks."""
    global OTHER_LAYOUT
    root = tmp_path_factory.mktemp("torch-faults")
    entry = ds.path(dcp_save_name(2))
    OTHER_LAYOUT = root / "other"
    OTHER_LAYOUT.write_text(ds.path(dcp_save_name(3)).name)  # the other layout's save (ws 3)
    jobs = []
    for name, fault in sorted(FAULTS.items()):
        directory = root / name / "dcp"
        shutil.copytree(entry / "dcp", directory)
        fault.mutate(directory, entry)
        jobs.append([str(directory), str(root / name / "out.pt"), str(entry / "oracle.pt")])
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(MEASURE), str(root / "jobs.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()[-len(jobs) :]
    return {
        name: (json.loads(line), (root / name / "payload-ran").exists())
        for name, line in zip(sorted(FAULTS), lines, strict=True)
    }


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault(name, ds, tmp_path, torch_outcomes):
    fault = FAULTS[name]
    entry = ds.path(dcp_save_name(2))
    directory = tmp_path / "dcp"
    (tmp_path / "other").write_text(ds.path(dcp_save_name(3)).name)  # the other layout's save (ws 3)
    global OTHER_LAYOUT
    OTHER_LAYOUT = tmp_path / "other"
    shutil.copytree(entry / "dcp", directory)
    fault.mutate(directory, entry)

    meta, findings = check_dcp(directory)
    print([f.to_line() for f in findings])
    assert [(f.code, f.file) for f in findings] == list(zip(fault.codes, fault.files))
    assert fault.says in (findings[0].message if findings else "")
    for output in ("text", "json"):  # the command: exit 1 with the codes, 0 when nothing is found, never a traceback
        result = _validate(directory, output)
        assert result.exit_code == (1 if fault.codes else 0), result.output
        assert "Traceback" not in result.output
    assert [f["code"] for f in json.loads(result.output)["findings"]] == fault.codes
    assert "optim.param_groups.0.lr" in bytes_entries(meta)
    sentinel = tmp_path / "payload-ran"
    assert not sentinel.exists()  # read by the restricted reader only: nothing it names ran

    measured, ran = torch_outcomes[name]
    print(measured)
    outcome = " ".join(filter(None, [measured["outcome"], measured.get("error", "").split(":")[0]]))
    assert outcome + (", runs the payload" if ran else "") == fault.torch
