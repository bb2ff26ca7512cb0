import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ckptspec.checkpoint.torchfile import (
    DynamicLossScalerState,
    FragmentAddress,
    LossScalerState,
    TensorRef,
    ZeroStage,
    iter_tensor_refs,
    read_pt_metadata,
    tensor_byte_range,
    zip_member_locations,
)
from ckptspec.errors import NotATorchFile, TorchFileError, TruncatedFile, UnsafePickleError

REPO = Path(__file__).resolve().parents[2]


def _torch_tensors(obj, path=()):
    """Mirror of iter_tensor_refs over a real torch.load result."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _torch_tensors(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _torch_tensors(v, path + (i,))


def _raw_bytes(path, ref, locations):
    import numpy as np

    offset, nbytes = tensor_byte_range(ref, locations)
    return np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset).tobytes()


def _save_zip(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


# --- real DeepSpeed checkpoints ------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "s1-bf16-ws2",
        "s1-fp16-ws2",
        "s1-fp32-ws3-rr",
        "s2-bf16-ws2",
        "s2-fp16-ws2-groups",
        "s2-fp32-ws3-rr",
        "s3-bf16-ws2-sub",
        "s3-fp16-ws3-groups",
        "s3-fp32-ws2-exclude",
    ],
)
def test_real_checkpoint_files(ds, name):
    import torch
    from _harness.scenarios import MATRIX_SPECS

    spec, world_size = MATRIX_SPECS[name]  # stages 1-3 x bf16/fp16/fp32, shared with the other suites
    stage, dtype = spec["stage"], spec["dtype"]
    save_dir = ds.path(name)
    tag = json.loads((save_dir / "harness.json").read_text())["tag"]
    files = sorted((save_dir / tag).glob("*.pt")) + [save_dir / "live_fp32.pt"]
    assert len(files) >= 3

    checked_groups = 0
    for f in files:
        meta = read_pt_metadata(f)
        locations = zip_member_locations(f)
        real = torch.load(f, map_location="cpu", weights_only=False)
        refs, tensors = dict(iter_tensor_refs(meta)), dict(_torch_tensors(real))
        assert refs.keys() == tensors.keys(), f
        for key, t in tensors.items():
            ref = refs[key]
            assert (ref.shape, ref.stride, ref.storage_offset) == (tuple(t.shape), t.stride(), t.storage_offset())
            assert ref.dtype == str(t.dtype).removeprefix("torch."), (f, key)

        if "optim_states" in f.name:
            osd = meta["optimizer_state_dict"]
            want = ZeroStage(stage)
            assert osd["zero_stage"] == want and isinstance(osd["zero_stage"], ZeroStage)
            scaler = DynamicLossScalerState if dtype == "fp16" else LossScalerState
            assert type(osd["loss_scaler"]) is scaler
            group_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
            for i, ref in enumerate(osd[group_key]):
                expected = real["optimizer_state_dict"][group_key][i]
                assert ref.dtype == "float32"
                # The bytes at the computed file offsets are exactly the tensor's values.
                raw = _raw_bytes(f, ref, locations)
                assert raw == expected.contiguous().view(torch.uint8).numpy().tobytes(), (f, i)
                checked_groups += 1
            if stage < 3:
                mappings = osd["param_slice_mappings"]
                assert all(isinstance(a, FragmentAddress) for m in mappings for a in m.values())
    assert checked_groups >= 2


# --- hostile and broken files --------------------------------------------------------------


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))  # unpickling this creates the file


def test_malicious_pickle_is_refused(tmp_path):
    import torch

    target = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "x": _Evil(str(target))}, evil)

    with pytest.raises(UnsafePickleError, match=r"global [\w.]*\.open\b") as exc:  # io.open on 3.11
        read_pt_metadata(evil)
    assert str(evil) in str(exc.value)
    assert not target.exists()

    # Control: the payload is live, an unrestricted load does create the file.
    control = tmp_path / "control"
    torch.save({"x": _Evil(str(control))}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()


def test_handwritten_protocol0_global_is_refused(tmp_path):
    # No torch needed: GLOBAL 'os system' + REDUCE, the classic payload.
    target = tmp_path / "pwned"
    payload = f"cos\nsystem\n(S'touch {target}'\ntR.".encode()
    f = _save_zip(tmp_path / "a.pt", {"a/data.pkl": payload, "a/version": b"3\n"})
    with pytest.raises(UnsafePickleError, match=r"os\.system"):
        read_pt_metadata(f)
    assert not target.exists()


def test_allowlisted_callable_with_bad_arguments(tmp_path):
    # An allowlisted global used with unexpected arguments is an error, not a call into torch.
    payload = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(X\x03\x00\x00\x00abcK\x00))\x89NtR."
    f = _save_zip(tmp_path / "a.pt", {"a/data.pkl": payload})
    with pytest.raises(TorchFileError, match="malformed"):
        read_pt_metadata(f)


def test_truncated_file(tmp_path):
    import torch

    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10000, dtype=torch.float32)}, good)
    data = good.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    for fn in (read_pt_metadata, zip_member_locations):
        with pytest.raises(TruncatedFile, match="cut.pt"):
            fn(cut)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(TruncatedFile, match="empty"):
        read_pt_metadata(empty)


def test_not_a_torch_file(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("hello, not a zip")
    with pytest.raises(NotATorchFile, match="notes.pt"):
        read_pt_metadata(text)
    plain_zip = _save_zip(tmp_path / "plain.zip", {"readme.txt": b"hi"})
    with pytest.raises(NotATorchFile, match="data.pkl"):
        read_pt_metadata(plain_zip)


def test_legacy_torch_format_is_not_a_torch_zip(tmp_path):
    import torch

    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(NotATorchFile, match="legacy"):
        read_pt_metadata(legacy)


def test_pickle_size_cap_and_compressed_members(tmp_path):
    f = _save_zip(tmp_path / "a.pt", {"a/data.pkl": pickle.dumps({"k": 1}, protocol=2)})
    assert read_pt_metadata(f) == {"k": 1}
    with pytest.raises(TorchFileError, match="cap"):
        read_pt_metadata(f, max_pickle_bytes=5)
    z = _save_zip(
        tmp_path / "z.pt", {"a/data.pkl": pickle.dumps({}), "a/data/0": b"\0" * 64}, compression=zipfile.ZIP_DEFLATED
    )
    with pytest.raises(TorchFileError, match="compressed"):
        zip_member_locations(z)


def test_tensor_refs_and_offsets(tmp_path):
    import torch

    base = torch.arange(12, dtype=torch.bfloat16)
    obj = {"view": base[2:10].view(2, 4), "p": torch.nn.Parameter(torch.ones(3)), "size": torch.Size([2, 3])}
    f = tmp_path / "t.pt"
    torch.save(obj, f)
    meta = read_pt_metadata(f)
    view = meta["view"]
    assert isinstance(view, TensorRef) and view.dtype == "bfloat16"
    assert (view.shape, view.stride, view.storage_offset, view.storage.numel) == ((2, 4), (4, 1), 2, 12)
    assert view.storage.member == "t/data/0"
    assert meta["p"].is_parameter and meta["p"].requires_grad
    assert meta["size"] == (2, 3)
    raw = _raw_bytes(f, view, zip_member_locations(f))
    assert raw == obj["view"].contiguous().view(torch.uint8).numpy().tobytes()


def test_module_imports_neither_torch_nor_deepspeed(tmp_path):
    # A real torch file is read in a fresh interpreter where torch/deepspeed cannot be imported.
    import torch

    f = tmp_path / "t.pt"
    torch.save({"w": torch.ones(4)}, f)
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None\n"
        "from ckptspec.checkpoint.torchfile import read_pt_metadata\n"
        f"print(read_pt_metadata({str(f)!r})['w'].shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(4,)"


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_metadata_read_skips_tensor_data(tmp_path):
    import torch

    f = tmp_path / "big.pt"
    torch.save({"a": torch.zeros(4 * 1024 * 1024), "b": torch.zeros(1024, 1024)}, f)  # ~20 MB

    def rchar():
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])

    before = rchar()
    meta = read_pt_metadata(f)
    zip_member_locations(f)
    assert rchar() - before < 512 * 1024
    assert meta["a"].shape == (4 * 1024 * 1024,)
