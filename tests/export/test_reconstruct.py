"""Reconstruction of full weights against real DeepSpeed checkpoints.

For every matrix point the output of ``ckptspec reconstruct`` is compared bit for bit
with DeepSpeed's own ``zero_to_fp32`` (every key it returns) and with the fp32 master
weights read from the live engine before saving (``live_fp32.pt``). Frozen params,
buffers and aliases are checked against the model-states file, and the output
options (dtype, shards, --untie, --format torch), the metadata, the refusal of a
damaged checkpoint and the bytes actually read are tested on a few points.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as safetensors_torch
import torch
from _harness.reconstruction import bits, check_reconstruction, same_bits
from _harness.scenarios import MATRIX, MATRIX_SPECS, engine_name

from ckptspec.deepspeed.describe import describe
from ckptspec.deepspeed.layout.tag_dir import resolve_tag_dir


@pytest.fixture(scope="session")
def _cli(ckptspec_process):
    def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = ckptspec_process(args)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    return _cli


def _model_states(save_dir) -> dict:
    tag_dir = resolve_tag_dir(save_dir)
    first = sorted(tag_dir.glob("*model_states.pt"))[0]
    return torch.load(first, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module", params=MATRIX)
def checkpoint(request, ds):
    spec, world_size = MATRIX_SPECS[request.param]
    return request.param, ds.path(request.param), spec, world_size


@pytest.fixture(scope="module")
def point(ds):
    """A matrix point by name."""
    return ds.path


def test_bit_exact_against_zero_to_fp32_and_live_engine(checkpoint, zero_to_fp32, tmp_path):
    name, save_dir, spec, world_size = checkpoint
    # DeepSpeed's zero_to_fp32 cannot read BF16_Optimizer checkpoints (grad_accum_dtype fp32).
    reads_it = spec.get("grad_accum_dtype") != "fp32"
    check_reconstruction(save_dir, tmp_path / "out", zero_to_fp32, stage=spec["stage"], zero_to_fp32_reads_it=reads_it)


@pytest.mark.parametrize("name", ["s1-bf16-ws2", "s1-fp16-ws2", "s1-fp32-ws3-rr", "s1-bf16-ws2-bf16opt"])
def test_stage1_keeps_frozen_params(_cli, point, name, tmp_path):
    """zero_to_fp32 drops them (DeepSpeed #5439); they are in `module`, in the model dtype."""
    save_dir = point(name)
    out = tmp_path / "out"
    _cli("reconstruct", str(save_dir), str(out), "--quiet")
    stored = safetensors_torch.load_file(out / "model.safetensors")
    module = _model_states(save_dir)["module"]
    for key in ("frozen.weight", "frozen.bias"):
        assert same_bits(stored[key], module[key])
    with safetensors_open(out / "model.safetensors") as f:
        frozen_source = json.loads(f.metadata()["ckptspec.frozen_source"])
    model_dtype = str(module["frozen.weight"].dtype).removeprefix("torch.")
    assert frozen_source == {"frozen.weight": model_dtype, "frozen.bias": model_dtype}


def safetensors_open(path):
    from safetensors import safe_open

    return safe_open(path, framework="pt")


def test_metadata_traces_the_checkpoint(_cli, point, tmp_path):
    save_dir = point("s3-bf16-ws2-sub")
    out = tmp_path / "out"
    _cli("reconstruct", str(save_dir), str(out), "--quiet")
    manifest = tmp_path / "manifest.json"
    _cli("generate", str(save_dir), "-o", str(manifest))
    with safetensors_open(out / "model.safetensors") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    # The manifest that was used, compact, with the SHA-256 of that text.
    assert json.loads(meta["ckptspec.manifest"]) == json.loads(manifest.read_text())
    assert meta["ckptspec.manifest_sha256"] == hashlib.sha256(meta["ckptspec.manifest"].encode()).hexdigest()
    assert meta["ckptspec.format_version"] == json.loads(manifest.read_text())["format_version"]
    assert json.loads(meta["ckptspec.aliases"]) == {"head.weight": "emb.weight"}
    assert meta["ckptspec.untied"] == "false"
    assert sorted(json.loads(meta["ckptspec.frozen_source"])) == ["frozen.bias", "frozen.weight"]
    assert meta["ckptspec.dtype"] == "float32"


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-fp16-ws3-groups", "s1-bf16-ws2-bf16opt"])
def test_the_output_says_what_each_tensor_is(_cli, point, name, tmp_path):
    """issue #37: ``ckptspec.sources`` names every written tensor under what its bytes are: the fp32
    masters the optimizer kept (the names whose masters the live engine held), frozen parameters'
    saved weights (no master), buffers. A shard lists its own tensors, the index every one, and the
    torch format's index too; an untied alias is its owner's bytes."""
    save_dir = point(name)
    states = _model_states(save_dir)
    aliases = states["shared_params"]
    masters = sorted(set(torch.load(save_dir / "live_fp32.pt", weights_only=True)) - set(aliases))
    buffers = sorted(states["buffer_names"])
    frozen = sorted(set(states["module"]) - set(masters) - set(buffers) - set(aliases))
    expected = {"buffer": buffers, "frozen_weight": frozen, "optimizer_fp32_master": masters}
    out, sharded, torch_out, untied = (tmp_path / d for d in ("out", "sharded", "torch", "untied"))
    _cli("reconstruct", str(save_dir), str(out), "--quiet")
    _cli("reconstruct", str(save_dir), str(sharded), "--quiet", "--max-shard-size", "1K")
    _cli("reconstruct", str(save_dir), str(torch_out), "--quiet", "--format", "torch")
    _cli("reconstruct", str(save_dir), str(untied), "--quiet", "--untie")
    with safetensors_open(out / "model.safetensors") as f:
        assert json.loads(f.metadata()["ckptspec.sources"]) == expected
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert json.loads(index["metadata"]["ckptspec.sources"]) == expected
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safetensors_open(sharded / shard) as f:
            mine = json.loads(f.metadata()["ckptspec.sources"])
            assert sorted(n for names in mine.values() for n in names) == sorted(f.keys())
        for origin, names in mine.items():
            merged.setdefault(origin, []).extend(names)
    assert {k: sorted(v) for k, v in merged.items()} == expected
    everything = {**expected, "optimizer_fp32_master": sorted([*masters, *aliases])}
    torch_index = json.loads((torch_out / "pytorch_model.bin.index.json").read_text())
    assert json.loads(torch_index["metadata"]["ckptspec.sources"]) == everything
    with safetensors_open(untied / "model.safetensors") as f:
        assert json.loads(f.metadata()["ckptspec.sources"]) == everything


def test_untie_and_both_layouts_load_into_the_model(_cli, point, tmp_path):
    from _harness.job.model import build_model, normalize_spec
    from safetensors.torch import load_model

    from ckptspec.export.api import load_consolidated

    save_dir = point("s2-bf16-ws2")
    spec = normalize_spec(MATRIX_SPECS["s2-bf16-ws2"][0])
    tied, untied = tmp_path / "tied", tmp_path / "untied"
    _cli("reconstruct", str(save_dir), str(tied), "--quiet")
    _cli("reconstruct", str(save_dir), str(untied), "--quiet", "--untie")

    copies = safetensors_torch.load_file(untied / "model.safetensors")
    assert torch.equal(bits(copies["head.weight"]), bits(copies["emb.weight"]))
    model = build_model(spec)
    model.load_state_dict(copies)  # strict: every key, nothing extra
    assert model.head.weight is model.emb.weight

    once = safetensors_torch.load_file(tied / "model.safetensors")
    assert "head.weight" not in once
    model = build_model(spec)
    missing, unexpected = load_model(model, tied / "model.safetensors")  # safetensors' tied-weights loader
    assert not missing and not unexpected
    model = build_model(spec)
    state = load_consolidated(tied)
    assert state["head.weight"] is state["emb.weight"]
    model.load_state_dict(state)
    for key, value in model.state_dict().items():
        assert torch.equal(bits(value), bits(copies[key].to(value.dtype))), key


def test_sharded_output_has_the_hugging_face_index(_cli, point, tmp_path):
    save_dir = point("s2-fp16-ws2-groups")
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    _cli("reconstruct", str(save_dir), str(single), "--quiet")
    _cli("reconstruct", str(save_dir), str(sharded), "--quiet", "--max-shard-size", "1K")
    files = sorted(p.name for p in sharded.iterdir())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert files == sorted(shards + ["model.safetensors.index.json"])
    assert len(shards) > 2 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    whole = safetensors_torch.load_file(single / "model.safetensors")
    merged = {}
    for shard in shards:
        part = safetensors_torch.load_file(sharded / shard)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 1024 or len(part) == 1
        assert all(index["weight_map"][k] == shard for k in part)
        merged |= part
    assert sorted(merged) == sorted(whole)
    assert all(torch.equal(bits(merged[k]), bits(whole[k])) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    with safetensors_open(single / "model.safetensors") as f:
        meta = f.metadata()
    assert {k: v for k, v in index["metadata"].items() if k != "total_size"} == meta


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["s2-fp32-ws3-rr", "s3-fp16-ws3-groups"])
def test_output_dtype_rounds_like_torch(_cli, zero_to_fp32, point, name, dtype, tmp_path):
    save_dir = point(name)
    out = tmp_path / "out"
    _cli("reconstruct", str(save_dir), str(out), "--quiet", "--untie", "--dtype", dtype)
    stored = safetensors_torch.load_file(out / "model.safetensors")
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reference = zero_to_fp32(save_dir)
    for key, theirs in reference.items():
        expected = theirs.to(target) if theirs.is_floating_point() else theirs
        assert stored[key].dtype == expected.dtype, key
        assert torch.equal(bits(stored[key]), bits(expected)), key


def test_torch_format(_cli, zero_to_fp32, point, tmp_path):
    save_dir = point("s3-bf16-ws2-sub")
    out = tmp_path / "out"
    _cli("reconstruct", str(save_dir), str(out), "--quiet", "--format", "torch")
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin", "pytorch_model.bin.index.json"]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr(), "the tie is kept as shared storage"
    reference = zero_to_fp32(save_dir)
    assert sorted(state) == sorted(reference)
    assert all(same_bits(state[k], reference[k]) for k in reference)
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert len(index["metadata"]["ckptspec.manifest_sha256"]) == 64


def test_python_api_torch_and_numpy_agree(zero_to_fp32, point):
    import numpy as np

    import ckptspec

    save_dir = point("s2-bf16-ws2-align")
    as_torch = ckptspec.load_state_dict(save_dir)
    as_numpy = ckptspec.load_state_dict(save_dir, framework="numpy")
    assert list(as_torch) == list(as_numpy)
    assert as_torch["head.weight"] is as_torch["emb.weight"]
    for key, tensor in as_torch.items():
        assert isinstance(as_numpy[key], np.ndarray)
        assert tuple(tensor.shape) == as_numpy[key].shape
        assert tensor.contiguous().numpy().tobytes() == as_numpy[key].tobytes(), key
    reference = zero_to_fp32(save_dir)
    assert all(same_bits(as_torch[k], v) for k, v in reference.items())


def test_manifest_option_gives_the_same_output(_cli, point, tmp_path):
    """--manifest with a generated manifest, and with the live engine's one (it lists no files)."""
    save_dir = point("s2-fp16-ws3-align")
    plain = tmp_path / "plain"
    _cli("reconstruct", str(save_dir), str(plain), "--quiet")
    generated = tmp_path / "m.json"
    _cli("generate", str(save_dir), "-o", str(generated), "--hash")
    via_manifest = tmp_path / "via-manifest"
    _cli("reconstruct", str(save_dir), str(via_manifest), "--quiet", "--manifest", str(generated))
    ours = safetensors_torch.load_file(via_manifest / "model.safetensors")
    base = safetensors_torch.load_file(plain / "model.safetensors")
    assert sorted(ours) == sorted(base) and all(torch.equal(bits(ours[k]), bits(base[k])) for k in base)
    with safetensors_open(via_manifest / "model.safetensors") as f:
        assert json.loads(f.metadata()["ckptspec.manifest"]) == json.loads(generated.read_text())
    engine = point(engine_name("s2-fp16-ws3-align")) / "engine_manifest.rank0.json"  # the live engine's: no files
    via_engine = tmp_path / "via-engine"
    _cli("reconstruct", str(save_dir), str(via_engine), "--quiet", "--manifest", str(engine))
    ours = safetensors_torch.load_file(via_engine / "model.safetensors")
    assert sorted(ours) == sorted(base) and all(torch.equal(bits(ours[k]), bits(base[k])) for k in base)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("existing", [False, True])
def test_damaged_checkpoint_exits_1_and_writes_nothing(_cli, point, tmp_path, existing):
    save_dir = point("s2-bf16-ws2")
    copy = tmp_path / "ckpt"
    shutil.copytree(save_dir, copy)
    _truncate(sorted(resolve_tag_dir(copy).glob("*optim_states.pt"))[1])
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"previous run")
    result = _cli("reconstruct", str(copy), str(out), check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "optim_states.pt" in result.stderr
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        assert (out / "model.safetensors").read_bytes() == b"previous run"
    else:
        assert not out.exists()


def _edit_model_states(save_dir: Path, change) -> None:
    path = sorted(resolve_tag_dir(save_dir).glob("*model_states.pt"))[0]
    state = torch.load(path, map_location="cpu", weights_only=False)
    change(state["module"])
    torch.save(state, path)  # same name, so the archive name inside the zip stays right


def test_files_changed_after_validation_are_refused_by_the_plan(point, tmp_path):
    """CK401: the plan reads the files again and finds what validation did not see (here a buffer
    re-saved in another dtype between validating and planning); nothing is read or written."""
    from ckptspec.checkpoint.states import StateCache
    from ckptspec.deepspeed.check.zero import validate_checkpoint
    from ckptspec.errors import InvalidCheckpoint
    from ckptspec.export.plan import plan_reconstruction
    from ckptspec.format.migrate import migrate_document
    from ckptspec.format.models import Manifest

    copy = tmp_path / "ckpt"
    shutil.copytree(point("s2-bf16-ws2"), copy)
    manifest, findings = validate_checkpoint(copy)
    assert findings == []
    _edit_model_states(copy, lambda module: module.__setitem__("running", module["running"].double()))
    # Format 1.1: the re-save moved every member, so the first located tensor's locator is stale.
    with pytest.raises(InvalidCheckpoint) as info:
        plan_reconstruction(copy, manifest, states=StateCache())
    assert info.value.code == "CK401" and info.value.exit_code == 1
    assert info.value.message == "'frozen.weight': the manifest's locators no longer match the file"
    # Format 1.0 (no locators): the buffer's own record says what changed.
    old = Manifest.model_validate(migrate_document(manifest.to_dict(), "1.0").document)
    with pytest.raises(InvalidCheckpoint) as info:
        plan_reconstruction(copy, old, states=StateCache())
    assert info.value.code == "CK401" and info.value.exit_code == 1
    assert "buffer 'running' is float64, the manifest says float32" in info.value.message


def test_a_tensor_that_cannot_be_written_as_asked_is_refused(_cli, point, tmp_path):
    """CK402: a buffer saved as a strided view has no single byte range; nothing is written."""
    copy = tmp_path / "ckpt"
    shutil.copytree(point("s2-bf16-ws2"), copy)
    _edit_model_states(copy, lambda module: module.__setitem__("running", torch.zeros(2 * 16)[::2]))
    assert _cli("validate", str(copy)).returncode == 0  # the files are consistent; only their form is unusual
    # A writer locates no non-contiguous tensor (spec.md#byte-order): then no named tensor at all.
    generated = json.loads(_cli("generate", str(copy)).stdout)
    assert not any("tensors" in f for f in generated["files"]) and generated["format_version"] == "1.1.0"
    out = tmp_path / "out"
    result = _cli("reconstruct", str(copy), str(out), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "CK402 'running' is stored as a non-contiguous view" in result.stderr, result.stderr
    assert not out.exists()


def test_no_progress_bar_without_a_terminal(_cli, point, tmp_path):
    save_dir = point("s2-bf16-ws1")
    result = _cli("reconstruct", str(save_dir), str(tmp_path / "out"))
    assert result.stderr == ""
    assert "wrote" in result.stdout and "model.safetensors" in result.stdout
    quiet = _cli("reconstruct", str(save_dir), str(tmp_path / "out2"), "--quiet")
    assert quiet.stdout == quiet.stderr == ""


def test_rerun_replaces_stale_shards(_cli, point, tmp_path):
    save_dir = point("s2-bf16-ws1")
    out = tmp_path / "out"
    _cli("reconstruct", str(save_dir), str(out), "--quiet", "--max-shard-size", "1K")
    (out / "notes.txt").write_text("mine")
    _cli("reconstruct", str(save_dir), str(out), "--quiet")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]


@pytest.mark.parametrize("name", ["s2-bf16-ws2", "s3-fp16-ws3-groups"])
def test_reads_only_fp32_partitions_and_needed_module_tensors(point, name, tmp_path, monkeypatch):
    """No byte of the Adam moments (exp_avg, exp_avg_sq) is read, and no byte twice."""
    from ckptspec.checkpoint import torchfile
    from ckptspec.export import api as rc

    save_dir = point(name)
    reads: list[tuple[str, int, int]] = []

    def path_of(fd):
        return os.readlink(f"/proc/self/fd/{fd}")

    real_preadv, real_copy = os.preadv, os.copy_file_range

    def preadv(fd, buffers, offset, *args):
        n = real_preadv(fd, buffers, offset, *args)
        reads.append((path_of(fd), offset, n))
        return n

    def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
        n = real_copy(src, dst, count, offset_src, offset_dst)
        reads.append((path_of(src), offset_src, n))
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    runs = []
    for dtype in ("fp32", "bf16"):  # a kernel copy, and the chunked-cast path
        reads.clear()
        rc.reconstruct(save_dir, tmp_path / dtype, dtype=dtype)
        runs.append(list(reads))

    moments = []  # (path, start, end) of every Adam moment's bytes
    for optim in resolve_tag_dir(save_dir).glob("*optim_states.pt"):
        members = torchfile.zip_member_locations(optim)
        state = torchfile.read_pt_metadata(optim)
        for key_path, ref in torchfile.iter_tensor_refs(state["optimizer_state_dict"]):
            if "exp_avg" in key_path or "exp_avg_sq" in key_path:
                start, size = members[ref.storage.member]
                moments.append((str(optim.resolve()), start, start + size))
    assert moments
    manifest = describe(save_dir)
    expected = sum(p.numel for g in manifest.groups for p in g.params) * 4  # the fp32 masters, once
    for run in runs:
        assert run
        for path, offset, n in run:
            for m_path, start, end in moments:
                assert not (path == m_path and offset < end and start < offset + n), f"read Adam moment bytes in {path}"
        by_file: dict[str, list[tuple[int, int]]] = {}
        for path, offset, n in run:
            by_file.setdefault(path, []).append((offset, offset + n))
        for path, ranges in by_file.items():
            ranges.sort()
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:])), (
                f"{path}: a byte read twice"
            )
        optim_bytes = sum(n for path, _, n in run if path.endswith("optim_states.pt"))
        assert optim_bytes == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal test")
def test_progress_bar_on_a_terminal(_cli, point, tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    save_dir = point("s2-bf16-ws1")
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 100-column terminal, as tqdm sizes its bar to it
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.execv(
            sys.executable, [sys.executable, "-m", "ckptspec", "reconstruct", str(save_dir), str(tmp_path / "out")]
        )
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "reconstruct" in text and "%" in text and "wrote" in text
    quiet = _cli("reconstruct", str(save_dir), str(tmp_path / "quiet"), "--quiet")
    assert quiet.stdout == quiet.stderr == ""


@pytest.mark.parametrize("existing", [False, True])
def test_failed_write_leaves_the_output_directory_as_it_was(point, tmp_path, monkeypatch, existing):
    import errno

    from ckptspec.export import api as rc
    from ckptspec.export.safetensors_writer import SafetensorsWriter

    save_dir = point("s2-fp16-ws2-groups")
    out = tmp_path / "out"
    if existing:  # an earlier reconstruction (another checkpoint's) the failed run would have replaced
        rc.reconstruct(point("s2-bf16-ws2"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else {}
    calls = []

    def full_disk(self, fd, offset, nbytes):
        calls.append(nbytes)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, fd, offset, nbytes)

    real = SafetensorsWriter.copy_range
    monkeypatch.setattr(SafetensorsWriter, "copy_range", full_disk)
    with pytest.raises(OSError):
        rc.reconstruct(save_dir, out, max_shard_size=1024)
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary left either
    else:
        assert not out.exists()
