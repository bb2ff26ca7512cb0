"""The restricted reader of a DCP ``.metadata`` (issue #42), against the real saves of tests/_harness/dcp_save_job.py.

``ckptspec.checkpoint.dcp.metadata.read_metadata`` reads what torch's ``FileSystemReader.read_metadata`` reads,
entry for entry and item for item, without torch and without running the pickle. A forged ``.metadata`` whose
pickle runs a payload is refused by the global's name and the payload never runs; torch's own ``dcp.load`` of the
same directory runs it (measured here, in a process of its own).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name

from ckptspec.checkpoint.dcp.checks import bytes_values
from ckptspec.checkpoint.dcp.metadata import BytesEntry, read_metadata
from ckptspec.errors import PickleOverCap, UnsafePickleError


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
def test_reads_what_torch_reads(world_size, save, ds):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = ds.path(dcp_save_name(world_size)) / save
    ours, theirs = read_metadata(directory), FileSystemReader(str(directory)).read_metadata()
    assert list(ours.entries) == list(theirs.state_dict_metadata)
    for fqn, entry in ours.entries.items():
        meta = theirs.state_dict_metadata[fqn]
        if isinstance(meta, BytesStorageMetadata):
            assert entry == BytesEntry()
            continue
        assert entry.dtype == str(meta.properties.dtype).removeprefix("torch.")
        assert entry.size == tuple(meta.size)
        assert [(c.offsets, c.sizes) for c in entry.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
    assert [(i.fqn, i.chunk_offset, i.index, i.file, i.offset, i.length) for i in ours.items] == [
        (k.fqn, None if k.offset is None else tuple(k.offset), k.index, v.relative_path, v.offset, v.length)
        for k, v in theirs.storage_data.items()
    ]
    assert ours.files == [f"__{rank}_0.distcp" for rank in range(world_size)]
    # The optimizer's hyperparameters are bytes items: pickles, read by the restricted reader (plain values only).
    assert sorted(k for k, e in ours.entries.items() if isinstance(e, BytesEntry))[:2] == [
        "optim.param_groups.0.amsgrad",
        "optim.param_groups.0.betas",
    ]


@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_bytes_items_read_as_torch_reads_them(world_size, ds):
    """Every bytes item of a real save is a plain value, equal (and of the same type) to what torch's own
    consolidation of the save holds (the optimizer's param groups, flattened as DCP saves them)."""
    import torch

    entry = ds.path(dcp_save_name(world_size))
    meta = read_metadata(entry / "dcp")
    ours = bytes_values(entry / "dcp", meta)
    groups = torch.load(entry / "torch_save.pt", weights_only=True)["optim"]["param_groups"]
    theirs = {f"optim.param_groups.{i}.{k}": v for i, g in enumerate(groups) for k, v in g.items()}
    assert len(ours) == 24 and sorted(ours) == sorted(theirs)
    for fqn, value in ours.items():
        assert (type(value), value) == (type(theirs[fqn]), theirs[fqn]), fqn


class _Payload:
    def __init__(self, sentinel):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _forge(source, target, sentinel):
    """A copy of ``source`` whose ``.metadata`` is the real one with its ``version`` replaced by a payload."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(source, target)
    metadata = FileSystemReader(str(source)).read_metadata()
    metadata.storage_meta = None
    metadata.version = _Payload(sentinel)
    (target / ".metadata").write_bytes(pickle.dumps(metadata))


TORCH_LOAD = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
print(sorted(torch.load(sys.argv[2], weights_only=True)["model"]))
"""


def test_a_forged_metadata_is_refused_and_never_run_torch_runs_it(ds, tmp_path):
    sentinel = tmp_path / "payload-ran"
    forged = tmp_path / "forged"
    _forge(ds.path(dcp_save_name(2)) / "dcp", forged, sentinel)

    with pytest.raises(UnsafePickleError) as refused:
        read_metadata(forged)
    assert refused.value.code == "CK204"
    assert "references global posix.system, which is not allowlisted" in str(refused.value)
    assert not sentinel.exists()

    # torch's own load of the same directory (one process, no process group): the payload runs, the load succeeds.
    done = subprocess.run(
        [sys.executable, "-c", TORCH_LOAD, str(forged), str(tmp_path / "out.pt")], capture_output=True, text=True
    )
    assert sentinel.exists()
    assert done.returncode == 0, done.stderr
    assert "'l1.weight'" in done.stdout


def test_a_global_off_the_list_is_named(ds, tmp_path):
    """Not only code: any global torch's metadata does not use is refused by name (here an OrderedDict)."""
    import collections

    from torch.distributed.checkpoint import FileSystemReader

    source = ds.path(dcp_save_name(1)) / "dcp"
    shutil.copytree(source, tmp_path / "odd")
    metadata = FileSystemReader(str(source)).read_metadata()
    metadata.planner_data = collections.OrderedDict(metadata.planner_data)
    (tmp_path / "odd" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafePickleError, match="global collections.OrderedDict, which is not allowlisted"):
        read_metadata(tmp_path / "odd")


def test_a_metadata_over_the_cap_is_refused_unread(ds, monkeypatch):
    directory = ds.path(dcp_save_name(3)) / "dcp"
    size = (directory / ".metadata").stat().st_size
    monkeypatch.setenv("CKPTSPEC_MAX_PICKLE_BYTES", str(size - 1))
    with pytest.raises(PickleOverCap, match=f"holds {size} bytes, over the cap of {size - 1}") as refused:
        read_metadata(directory)
    assert refused.value.code == "CK225"
