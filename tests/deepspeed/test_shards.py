"""Shard validation against real DeepSpeed checkpoints.

Every clean checkpoint of the matrix validates with zero findings; every corruption of
tests/_harness/faults.py is reported with its own code, naming the file and rank, with exit 1, no
traceback, nothing written and no pickled code run.
"""

import inspect
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _harness.faults import FAULTS, FaultEnv, base_dir, snapshot, tag_dir
from _harness.scenarios import COMMITTED, MATRIX, engine_name
from click.testing import CliRunner

from ckptspec.checkpoint import torchfile
from ckptspec.cli import cli
from ckptspec.deepspeed.check.domain import CHECKS, check_checkpoint
from ckptspec.deepspeed.check.zero import validate_checkpoint
from ckptspec.deepspeed.describe import describe
from ckptspec.errors import CkptspecError, InvalidCheckpoint
from ckptspec.format.models import Manifest
from ckptspec.format.partition import natural_order


@pytest.fixture(scope="module")
def built(ds):
    """A fault's base or donor by name (tests/_harness/faults.py base_dir); the harness only when needed."""
    return lambda base: base_dir(base, lambda: ds)


@pytest.fixture(scope="session")
def _cli(ckptspec_process):
    def _cli(*args: str) -> subprocess.CompletedProcess:
        """The real command, in a subprocess: exit code, no traceback, nothing run."""
        return ckptspec_process(args)

    return _cli


def _run(*args: str):
    """The same command in-process (no interpreter start-up): for the cheaper assertions."""
    return CliRunner().invoke(cli, list(args))


def _copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(src, dest)
    return dest


# --------------------------------------------------------------------------- clean checkpoints


@pytest.mark.parametrize("name", MATRIX)
def test_clean_checkpoint_has_no_findings(_cli, name, built, tmp_path):
    save_dir = built(name)
    before = snapshot(save_dir)
    result = _cli("validate", str(save_dir), "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] and report["findings"] == []

    manifest = tmp_path / "manifest.json"
    assert _run("generate", str(save_dir), "--hash", "-o", str(manifest)).exit_code == 0
    result = _run("validate", str(manifest), "--checkpoint", str(save_dir), "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["findings"] == []

    # The live engine's manifest describes the layout only (no files): the files come from the directory.
    engine = Manifest.model_validate(json.loads((built(engine_name(name)) / "engine_manifest.rank0.json").read_text()))
    _, findings = validate_checkpoint(save_dir, engine)
    assert findings == [], [f.to_line() for f in findings]
    assert snapshot(save_dir) == before


def test_a_data_pkl_over_the_cap_is_ck225_naming_each_file(ckptspec_process, built):
    """#19: a real 1M-tensor save holds a 173 MiB data.pkl in its model states, over the old 64 MiB
    cap, and was refused as a damaged file (CK205, "restore it"). A data.pkl over the cap is now
    CK225, refused unread, naming each such file and the variable that raises the cap."""
    save_dir = built("committed:s2-bf16-ws2")
    sizes = {}
    for path in sorted(tag_dir(save_dir).glob("*.pt")):
        with zipfile.ZipFile(path) as zf:
            sizes[path.name] = next(i.file_size for i in zf.infolist() if i.filename.endswith("/data.pkl"))
    cap = sorted(sizes.values())[len(sizes) // 2]  # some files over it, some not
    over = {name for name, size in sizes.items() if size > cap}
    assert over and over != set(sizes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSPEC_")}

    result = ckptspec_process(
        ["validate", save_dir, "--format", "json"], env={**env, "CKPTSPEC_MAX_PICKLE_BYTES": str(cap)}
    )
    assert result.returncode == 1, result.stdout + result.stderr
    refused = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "CK225"]
    assert {f["file"] for f in refused} == over
    assert all("CKPTSPEC_MAX_PICKLE_BYTES" in f["hint"] and f"over the {cap} byte cap" in f["message"] for f in refused)

    at_cap = ckptspec_process(
        ["validate", save_dir], env={**env, "CKPTSPEC_MAX_PICKLE_BYTES": str(max(sizes.values()))}
    )
    assert at_cap.returncode == 0, at_cap.stdout + at_cap.stderr


# --------------------------------------------------------------------------- the fault suite


def test_suite_covers_every_check():
    from ckptspec.deepspeed.check.cross_domain import INDEX_CHECKS

    covered = {f.code for f in FAULTS}
    assert {c.code for c in CHECKS} <= covered, sorted({c.code for c in CHECKS} - covered)
    assert {c.code for c in INDEX_CHECKS} <= covered, sorted({c.code for c in INDEX_CHECKS} - covered)
    assert len({f.name for f in FAULTS}) == len(FAULTS) >= 15
    assert {
        "transposed-shape",
        "emptied-shared-params-s3",
        "reordered-param-shapes",
        "missing-rank",
        "stale-extra-rank",
        "truncated-shard",
        "empty-shard",
        "foreign-shard",
        "missing-stage3-model-states",
        "bad-latest",
        "swapped-rank-files",
        "malicious-pickle",
    } <= {f.name for f in FAULTS}


def _hashed_manifest(save_dir: Path, tmp_path: Path, fault) -> Path:
    """`generate --hash` of the clean checkpoint; for ``digests_only``, without the files' hashes."""
    manifest = tmp_path / "manifest.json"
    assert _run("generate", str(save_dir), "--hash", "-o", str(manifest)).exit_code == 0
    if fault.digests_only:
        doc = json.loads(manifest.read_text())
        for f in doc["files"]:
            del f["hash"]
        manifest.write_text(json.dumps(doc))
    return manifest


def _rank_of(name: str | None) -> int | None:
    import re

    match = re.search(r"zero_pp_rank_(\d+)_", name or "")
    # A model-parallel rank's mp_rank_XX_model_states.pt belongs to rank 0 of its domain.
    return int(match.group(1)) if match else (0 if re.fullmatch(r"mp_rank_\d+_model_states\.pt", name or "") else None)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_fault_is_reported(_cli, fault, built, tmp_path):
    save_dir = _copy(built(fault.base), tmp_path)
    args = ["validate", str(save_dir)]
    if fault.hashed_manifest:
        manifest = _hashed_manifest(save_dir, tmp_path, fault)
        args = ["validate", str(manifest), "--checkpoint", str(save_dir)]
    env = FaultEnv(built(fault.donor) if fault.donor else None, tmp_path / "pwned")
    fault.mutate(save_dir, env)
    assert not env.marker.exists()
    before = snapshot(tmp_path)

    invalid = fault.severity == "error"  # a warning is reported, and the checkpoint stays valid
    result = _cli(*args, "--format", "json")
    assert result.returncode == (1 if invalid else 0), result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] is not invalid
    if "error" in report:  # the checkpoint cannot be checked at all (bad latest, no model states)
        assert fault.file is None and report["error"]["code"] == fault.code
    else:
        hits = [f for f in report["findings"] if f["code"] == fault.code]
        assert hits, f"expected {fault.code}, got {[(f['code'], f.get('file')) for f in report['findings']]}"
        named = [f for f in hits if fault.file is None or f.get("file") == fault.file]
        assert named, f"{fault.code} does not name {fault.file}: {hits}"
        assert named[0].get("rank") == _rank_of(fault.file)
        assert named[0]["severity"] == fault.severity
        assert all(f["hint"] and f["message"] for f in report["findings"])

    text = _run(*args)
    assert text.exit_code == (1 if invalid else 0)
    assert text.exception is None or isinstance(text.exception, SystemExit)
    assert fault.code in text.output
    if fault.file:
        assert fault.file in text.stdout

    assert snapshot(tmp_path) == before, "validation wrote or changed a file"
    assert not env.marker.exists(), "pickled code ran"


def _findings_or_error(save_dir: Path, manifest: Path | None):
    try:
        return validate_checkpoint(save_dir, manifest)[1]
    except CkptspecError as exc:
        return exc.code


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_checks_shared_with_a_forked_process_find_what_one_process_finds(fault, built, tmp_path, monkeypatch):
    """A large manifest's checks run half in a forked copy of the process (``checks._run``): on every
    corruption, the same findings in the same order as all checks run here."""
    from ckptspec import _forked
    from ckptspec.deepspeed.check import domain as checks

    save_dir = _copy(built(fault.base), tmp_path)
    manifest = _hashed_manifest(save_dir, tmp_path, fault) if fault.hashed_manifest else None
    fault.mutate(save_dir, FaultEnv(built(fault.donor) if fault.donor else None, tmp_path / "pwned"))
    monkeypatch.setattr(checks, "FORK_MIN_PARAMS", 10**9)
    alone = _findings_or_error(save_dir, manifest)

    runs, sent = [], []
    run, result = checks._run, _forked.Forked.result
    monkeypatch.setattr(checks, "_run", lambda ctx: runs.append(ctx) or run(ctx))
    monkeypatch.setattr(_forked.Forked, "result", lambda self: sent.append(result(self)) or sent[-1])
    monkeypatch.setattr(_forked, "can_fork", lambda: True)  # pytest's own threads would forbid it
    monkeypatch.setattr(checks, "FORK_MIN_PARAMS", 0)
    shared = _findings_or_error(save_dir, manifest)
    assert shared == alone
    assert len(sent) == len(runs) and None not in sent  # every time the checks ran, a child sent its half


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_fault_is_refused_by_every_reader(_cli, fault, built, tmp_path):
    """reconstruct and load_state_dict refuse (exit 1, the fault's code, nothing written); inspect
    reports the code without a traceback. A warning is shown and does not stop any of them."""
    import ckptspec
    from ckptspec.errors import InvalidCheckpoint

    save_dir = _copy(built(fault.base), tmp_path)
    manifest_args, manifest = [], None
    if fault.hashed_manifest:
        manifest = _hashed_manifest(save_dir, tmp_path, fault)
        manifest_args = ["--manifest", str(manifest)]
    env = FaultEnv(built(fault.donor) if fault.donor else None, tmp_path / "pwned")
    fault.mutate(save_dir, env)
    before = snapshot(tmp_path)

    out = tmp_path / "out"
    result = _run("reconstruct", str(save_dir), str(out), "--quiet", *manifest_args)
    assert isinstance(result.exception, (SystemExit, type(None))), result.output
    assert fault.code in result.output, result.output
    if fault.severity == "warning":
        assert result.exit_code == 0 and (out / "model.safetensors").is_file(), result.output
        assert ckptspec.load_state_dict(save_dir, framework="numpy", manifest=manifest)
        shown = _cli("inspect", str(save_dir), "--format", "json")
        summary = json.loads(shown.stdout)
        assert shown.returncode == 0 and summary["valid"] and fault.code in {f["code"] for f in summary["findings"]}
        return
    assert result.exit_code == 1
    assert not out.exists() and snapshot(tmp_path) == before, "a refused reconstruction wrote something"

    with pytest.raises(InvalidCheckpoint) as info:
        ckptspec.load_state_dict(save_dir, framework="numpy", manifest=manifest)
    assert info.value.exit_code == 1
    codes = {f.code for f in getattr(info.value, "findings", [])} | {info.value.code}
    assert fault.code in codes, (info.value.to_line(), codes)

    shown = _cli("inspect", str(manifest) if manifest else str(save_dir), "--format", "json")
    assert "Traceback" not in shown.stdout + shown.stderr
    # A manifest file alone says nothing of the files; inspect checks them as `validate --no-hash` does.
    if not manifest and not fault.reads_data:
        assert shown.returncode == 1 and fault.code in shown.stdout + shown.stderr, shown.stdout + shown.stderr
    assert snapshot(tmp_path) == before
    assert not env.marker.exists(), "pickled code ran"


# --------------------------------------------------------------------------- sidecar, hashes, API


def _flip_a_tensor_byte(path: Path) -> None:
    """Bit rot inside the fp32 partition: metadata unchanged, only a content hash can tell."""
    state = torchfile.read_pt_metadata(path)
    ref = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    offset, _ = torchfile.tensor_byte_range(ref, torchfile.zip_member_locations(path))
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_sidecar_manifest_is_used_and_hashes_catch_bit_rot(_cli, built, tmp_path):
    save_dir = _copy(built("s2-bf16-ws2"), tmp_path)
    tag = tag_dir(save_dir)
    sidecar = tag / "ckptspec.json"
    sidecar.write_text(json.dumps(describe(save_dir, hash_algorithm="sha256").to_dict()))
    assert _run("validate", str(save_dir)).exit_code == 0
    victim = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip_a_tensor_byte(victim)

    result = _cli("validate", str(save_dir), "--format", "json")
    assert result.returncode == 1
    findings = json.loads(result.stdout)["findings"]
    # The file's hash, and the digest of the tensor the byte is in (l1.weight's master, whose elements
    # are in both ranks' files: no single file is named).
    assert [(f["code"], f.get("file"), f.get("rank"), f["path"]) for f in findings] == [
        ("CK209", victim.name, 1, "$.files[2].hash"),
        ("CK222", None, None, "$.groups[0].params[1].digest"),
    ]
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, " + victim.name in findings[1]["message"]
    assert _run("validate", str(save_dir), "--no-hash").exit_code == 0
    sidecar.unlink()  # without the recorded hash, the metadata alone cannot see bit rot
    assert _run("validate", str(save_dir)).exit_code == 0


def test_invalid_sidecar_is_reported(built, tmp_path):
    save_dir = _copy(built("s2-bf16-ws2"), tmp_path)
    doc = describe(save_dir).to_dict()
    doc["layout"]["world_size"] = 0
    (tag_dir(save_dir) / "ckptspec.json").write_text(json.dumps(doc))
    result = _run("validate", str(save_dir), "--format", "json")
    assert result.exit_code == 1
    findings = json.loads(result.stdout)["findings"]
    assert findings and all(f["file"] == "ckptspec.json" for f in findings)
    assert {f["code"] for f in findings} == {"CK001"}


def test_api(built, tmp_path):
    save_dir = built("s3-bf16-ws2-sub")
    manifest, findings = validate_checkpoint(save_dir)
    assert manifest is not None and findings == []
    assert check_checkpoint(manifest, tag_dir(save_dir)) == []
    assert validate_checkpoint(save_dir, tag="global_step2")[1] == []

    copy = _copy(save_dir, tmp_path)
    (copy / "latest").write_text("nope")
    with pytest.raises(InvalidCheckpoint) as info:
        validate_checkpoint(copy)
    assert info.value.code == "CK201" and info.value.exit_code == 1
    with pytest.raises(CkptspecError) as info:
        validate_checkpoint(tmp_path / "absent")
    assert info.value.code == "CK901" and info.value.exit_code == 2


def test_usage(_cli, built, tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(describe(built("s2-bf16-ws2")).to_dict()))
    assert _run("validate", str(manifest), "--tag", "global_step2").exit_code == 2
    result = _run("validate", str(manifest), "--checkpoint", str(tmp_path / "absent"), "--format", "json")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["code"] == "CK901"
    result = _cli("validate", str(manifest), "--checkpoint", str(built("s2-bf16-ws2")), "--tag", "global_step7")
    assert result.returncode == 1 and "CK201" in result.stderr and "Traceback" not in result.stderr


def test_round_robin_inverse():
    # DeepSpeed's _round_robin_reorder with dp=3: [emb, l1.w, l1.b, l2.w, l2.b] -> [emb, l2.w, l1.w, l2.b, l1.b]
    assert natural_order(["emb", "l2.w", "l1.w", "l2.b", "l1.b"], 3) == ["emb", "l1.w", "l1.b", "l2.w", "l2.b"]
    assert natural_order(list("abcdefg"), 1) == list("abcdefg")
    assert natural_order(["a", "c", "b"], 2) == ["a", "b", "c"]


def test_ties_are_looked_for_only_among_tensors_sharing_a_view():
    """CK219's undeclared-tie loop visits only the entries whose view (stage 3: storage) another
    tensor of the module has too, in module order (the fault corpus's emptied shared_params shows
    the rule end to end); nothing when every view is its own."""
    from ckptspec.deepspeed.check.domain.module import _STORAGE_KEY, _VIEW, _sharing_a_view

    flat, other = (torchfile.StorageRef(f"a/data/{k}", k, "float32", 4, 100, "cpu") for k in "01")
    module = {
        "a": torchfile.TensorRef(flat, 0, (2, 2), (2, 1)),
        "b": torchfile.TensorRef(flat, 4, (2, 2), (2, 1)),  # the same storage, another view
        "c": torchfile.TensorRef(flat, 0, (2, 2), (2, 1)),  # a's view
        "n": 3,  # not a tensor
        "d": torchfile.TensorRef(flat, 0, (4,), (1,)),  # a's storage and offset, another shape
        "e": torchfile.TensorRef(other, 0, (2, 2), (2, 1)),
        "f": torchfile.TensorRef(flat, 0, (2, 2), (2, 1)),
    }
    assert [name for name, _ in _sharing_a_view(module, _VIEW)] == ["a", "c", "f"]
    assert [name for name, _ in _sharing_a_view(module, _STORAGE_KEY)] == ["a", "b", "c", "d", "f"]
    assert list(_sharing_a_view({k: module[k] for k in "abden"}, _VIEW)) == []


# --------------------------------------------------------------------------- issue #22: messages a user reads


def test_optimizer_header_says_stage_numbers_and_what_the_counts_mean(built, tmp_path):
    """Defect 11: the manifest of a ZeRO-3 checkpoint (DeepSpeed 0.15.4) checked against the files of a
    ZeRO-2 one (0.19.8), both on two ranks, and the reverse."""
    stage3 = Path(__file__).resolve().parents[1] / "data" / "deepspeed-0.15.4" / "old-s3-bf16-ws2"
    stage2 = built("committed:s2-bf16-ws2")
    for manifest_of, files_of, says, is_stage, counts in (
        (stage3, stage2, 2, 3, "one per group"),
        (stage2, stage3, 3, 2, "one number"),
    ):
        manifest = tmp_path / f"{manifest_of.name}.json"
        assert _run("generate", str(manifest_of), "-o", str(manifest)).exit_code == 0
        result = _run("validate", str(manifest), "--checkpoint", str(files_of))
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if "CK211" in line]
        assert "ZeroStage" not in result.output, lines
        assert any(f"file says ZeRO stage {says}, the checkpoint is stage {is_stage}" in line for line in lines), lines
        partition = [line for line in lines if "partition count" in line]
        assert partition and all(counts in line for line in partition), partition


UNIVERSAL_ARGS = ["--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]


def test_universal_checkpoint_is_named_as_such(ds, built, tmp_path):
    """Defect 10: a folder written by DeepSpeed's ds_to_universal is not "ZeRO stage 0": since #17 it
    is described (a checkpoint index of kind "universal") by every command. DeepSpeed's folder is made once
    and cached (``ds.cached``, keyed on the committed checkpoint's files, the command and DeepSpeed's version)."""
    committed = built("committed:s2-bf16-ws2")

    def convert(directory: Path, env: dict) -> None:
        source = _copy(committed, directory)  # a copy, as before: the committed files are never a tool's input
        subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir(source))]
            + ["--output_folder", str(directory / "global_step2_universal"), *UNIVERSAL_ARGS],
            check=True,
            capture_output=True,
            env={**env, "DS_ACCELERATOR": "cpu"},
        )
        shutil.rmtree(source)

    identity = {"build": inspect.getsource(convert)}  # the command, its arguments
    converted = ds.cached("ds-to-universal-s2-bf16-ws2", identity, convert, sources=[committed])
    save_dir = _copy(committed, tmp_path)
    universal = save_dir / "global_step2_universal"
    shutil.copytree(converted / universal.name, universal)
    shutil.copy(converted / "latest_universal", save_dir)  # written beside its output folder, as in a run
    assert (universal / "zero").is_dir() and not list(universal.glob("*_optim_states.pt"))
    for args in (
        ["validate", str(save_dir), "--tag", universal.name],
        ["inspect", str(universal)],
        ["generate", str(universal)],
        ["reconstruct", str(universal), str(tmp_path / "OUT")],
    ):
        result = _run(*args)  # #17: described as a universal checkpoint index
        assert result.exit_code == 0, (args, result.output)
        assert "CK202" not in result.output and "stage 0" not in result.output, result.output
    assert '"kind": "universal"' in _run("generate", str(universal)).output


# --------------------------------------------------------------------------- format 1.1: digests


def _flip_at(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "kind,where,element,finding",
    [
        # Real elements: each kind of located tensor has a digest that sees the flip.
        ("master", ("partitions", 0), 0, ("CK222", "$.groups[0].params[1].digest")),
        ("state", ("state_partitions", 1), 950, ("CK222", "$.groups[0].params[4].state_digests.exp_avg_sq")),
        ("model weights", ("model_weights", 0), 1904, ("CK222", "$.groups[0].params[4].model_digest")),
        ("buffer", ("tensors", 3), 15, ("CK222", "$.buffers[1].digest")),
        # Padding: saved, but in no digest, so no finding (stage 3 leaves it uninitialised).
        ("master tail", ("partitions", 0), 952, None),
        ("state tail", ("state_partitions", 0), 953, None),
        ("model weights tail", ("model_weights", 0), 1906, None),
    ],
)
def test_digests_see_real_elements_not_padding(kind, where, element, finding, tmp_path):
    """A bit flipped in a real element is CK222 at that tensor's digest; one flipped in padding is
    not a finding. The manifest has no file hashes: only the tensor digests can tell."""
    from ckptspec.format.dtypes import ITEMSIZE

    save_dir = _copy(COMMITTED["s2-bf16-ws2"], tmp_path)
    doc = describe(save_dir, hash_algorithm="sha256").to_dict()
    for f in doc["files"]:
        del f["hash"]
    manifest = Manifest.model_validate(doc)
    # Rank 1's optimizer file (its partition is 951 real elements of 954), or the model states.
    shard = next(f for f in manifest.files if getattr(f, where[0]) and (f.role == "model_states" or f.ranks == [1]))
    loc = getattr(shard, where[0])[where[1]]
    _flip_at(tag_dir(save_dir) / shard.path, loc.data_offset + (loc.element_offset + element) * ITEMSIZE[loc.dtype])
    _, found = validate_checkpoint(save_dir, manifest)
    assert [(f.code, f.path) for f in found] == ([finding] if finding else [])
    _, unchecked = validate_checkpoint(save_dir, manifest, verify_hashes=False)
    assert unchecked == []  # without hashes nothing reads the bytes


def test_stage3_padding_is_in_no_digest(built, tmp_path):
    """Stage 3 leaves padding uninitialised (NaN in these files): rank 2's fragment of frozen.weight
    (256 elements over 3 ranks: 86, 86, 84 real) and rank 2's master partition of emb.weight (800
    over 3: 267, 267, 266 real) each end in padding. Flipping it is no finding; flipping the last
    real element before it is CK222 on that tensor alone."""
    from ckptspec.format.dtypes import ITEMSIZE

    def flipped(element_of, where):
        save_dir = _copy(built("s3-fp16-ws3-groups"), tmp_path / where)
        doc = describe(save_dir, hash_algorithm="sha256").to_dict()
        for f in doc["files"]:
            del f["hash"]
        manifest = Manifest.model_validate(doc)
        path, offset = element_of(manifest)
        _flip_at(tag_dir(save_dir) / path, offset)
        return [(f.code, f.path) for f in validate_checkpoint(save_dir, manifest)[1]]

    def fragment(element):
        def at(manifest):
            f = next(f for f in manifest.files if f.role == "model_states" and f.ranks == [2])
            loc = next(t for t in f.tensors if t.name == "frozen.weight")
            assert loc.numel == 84 and loc.member_size == 86 * ITEMSIZE[loc.dtype]
            return f.path, loc.data_offset + element * ITEMSIZE[loc.dtype]

        return at

    def master(element):
        def at(manifest):
            f = next(f for f in manifest.files if f.role == "optimizer_states" and f.ranks == [2])
            loc = next(p for p in f.partitions if p.group == 0)
            param = manifest.groups[0].params[0]
            assert param.name == "emb.weight" and param.offset == 0 and param.padding == 1
            return f.path, loc.data_offset + element * ITEMSIZE[loc.dtype]

        return at

    assert flipped(fragment(85), "fragment-padding") == []
    assert flipped(fragment(83), "fragment-real") == [("CK222", "$.frozen[0].digest")]
    assert flipped(master(266), "master-padding") == []
    assert flipped(master(265), "master-real") == [("CK222", "$.groups[0].params[0].digest")]
