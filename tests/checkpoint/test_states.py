"""The state reader: each file decoded once, and one mapping of unreadable files to CK204/CK205."""

from __future__ import annotations

import pickle
import zipfile

import pytest
import torch  # the test environment has it: missing torch is an error here, never a skip

from ckptspec.checkpoint import torchfile
from ckptspec.checkpoint.states import (
    DAMAGED_HINT,
    LEGACY_HINT,
    OVER_CAP_HINT,
    UNSAFE_HINT,
    StateCache,
    code_and_hint,
    unreadable,
)
from ckptspec.errors import InvalidCheckpoint, LegacyTorchFile, PickleOverCap, TorchFileError, UnsafePickleError


@pytest.fixture
def pt_file(tmp_path):
    path = tmp_path / "states.pt"
    torch.save({"w": torch.ones(4), "step": 3}, path)
    return path


def test_each_file_is_read_once(pt_file, monkeypatch):
    calls = []
    real = torchfile.read_pt_metadata
    monkeypatch.setattr(torchfile, "read_pt_metadata", lambda path: calls.append(path) or real(path))
    cache = StateCache()
    assert cache.state(pt_file)["step"] == 3
    assert cache.state(str(pt_file))["w"].shape == (4,)
    assert cache.load(pt_file.parent / "." / pt_file.name, members=True).members
    assert len(calls) == 1


def test_unreadable_files_map_to_one_code_and_hint_each(tmp_path):
    assert code_and_hint(UnsafePickleError("x.pt", "data.pkl references global os.system")) == ("CK204", UNSAFE_HINT)
    assert code_and_hint(TorchFileError("x.pt", "file is empty")) == ("CK205", DAMAGED_HINT)
    assert code_and_hint(LegacyTorchFile("x.pt", "legacy (non-zip) torch serialization")) == ("CK202", LEGACY_HINT)
    assert code_and_hint(PickleOverCap("x.pt", "data.pkl is 9 bytes, over the 8 byte cap")) == ("CK225", OVER_CAP_HINT)
    error = unreadable(TorchFileError(tmp_path / "x.pt", "file is empty"))
    assert (error.code, error.message, error.hint, error.file) == (
        "CK205",
        "file is empty",
        DAMAGED_HINT,
        str(tmp_path / "x.pt"),
    )
    assert str(TorchFileError(tmp_path / "x.pt", "file is empty")) == f"{tmp_path / 'x.pt'}: file is empty"


def test_a_code_running_pickle_is_ck204(tmp_path):
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(print, protocol=2))
    loaded = StateCache().load(path)
    assert isinstance(loaded.error, UnsafePickleError) and loaded.state is None
    with pytest.raises(InvalidCheckpoint) as info:
        StateCache().state(path)
    assert (info.value.code, info.value.hint) == ("CK204", UNSAFE_HINT)


def test_the_cap_comes_from_the_environment(pt_file, monkeypatch):
    """CKPTSPEC_MAX_PICKLE_BYTES sets the cap; a value that is not a positive integer keeps the default."""
    size = next(i.file_size for i in zipfile.ZipFile(pt_file).infolist() if i.filename.endswith("/data.pkl"))
    monkeypatch.setenv("CKPTSPEC_MAX_PICKLE_BYTES", str(size - 1))
    assert isinstance(StateCache().load(pt_file).error, PickleOverCap)
    for value in (str(size), "0", "-5", "lots"):
        monkeypatch.setenv("CKPTSPEC_MAX_PICKLE_BYTES", value)
        assert StateCache().state(pt_file)["step"] == 3
    monkeypatch.setenv("CKPTSPEC_MAX_PICKLE_BYTES", "lots")
    assert torchfile.pickle_cap() == torchfile.DEFAULT_MAX_PICKLE_BYTES == 256 * 2**20


def test_a_damaged_record_is_ck205_even_when_data_pkl_reads(pt_file):
    """A bad local header of a tensor record: data.pkl decodes, the member map does not."""
    with zipfile.ZipFile(pt_file) as zf:
        record = next(i for i in zf.infolist() if "/data/" in i.filename)
    with open(pt_file, "r+b") as fh:
        fh.seek(record.header_offset)
        fh.write(b"XXXX")
    cache = StateCache()
    assert cache.state(pt_file)["step"] == 3
    with pytest.raises(InvalidCheckpoint) as info:
        cache.members(pt_file)
    assert info.value.code == "CK205" and "bad local header signature" in info.value.message
