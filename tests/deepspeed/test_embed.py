"""Embedding (issue #6): sidecar, model-states client state, safetensors metadata, the DeepSpeed save hook.

The first part needs neither DeepSpeed nor a real checkpoint (synthetic torch and
safetensors files). The second part (marked ``deepspeed``) saves three real DeepSpeed
checkpoints through ``ckptspec.deepspeed.save_checkpoint`` (stages 1, 2 and 3, two and
three ranks), loads each back with ``engine.load_checkpoint`` inside the job, and
checks every copy of the manifest.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import uuid
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from _harness import scenarios

from ckptspec.checkpoint import torchfile
from ckptspec.checkpoint.embedded import (
    CLIENT_STATE_KEY,
    SAFETENSORS_KEY,
    SAFETENSORS_SHA256_KEY,
    EmbeddedCopy,
    agreement_findings,
    client_state_value,
    first_difference,
    layout_document,
    read_client_state_copy,
    safetensors_metadata,
)
from ckptspec.checkpoint.pt_rewrite import rewrite_pt_with_item
from ckptspec.checkpoint.sidecar import write_sidecar
from ckptspec.deepspeed.check.copies import embedded_findings
from ckptspec.errors import EmbedError, UnsupportedEngine
from ckptspec.format.codec import dumps, load_document
from ckptspec.format.validate import validate_document

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"


def example() -> dict:
    return json.loads(EXAMPLE.read_text("utf-8"))


@pytest.fixture(scope="session")
def run(ckptspec_process):
    def run(*args: str) -> subprocess.CompletedProcess:
        return ckptspec_process(args)

    return run


# --------------------------------------------------------------------------- client state in a torch file


@pytest.fixture
def pt_file(tmp_path):
    import torch

    path = tmp_path / "mp_rank_00_model_states.pt"
    state = {
        "module": collections.OrderedDict(
            w=torch.arange(10, dtype=torch.float32).view(2, 5),
            b=torch.ones(3, dtype=torch.bfloat16),
            s=torch.tensor(7, dtype=torch.int64),
        ),
        "param_shapes": [collections.OrderedDict(w=torch.Size([2, 5]))],
        "global_steps": 2,
        "ds_version": "0.19.8",
    }
    torch.save(state, path)
    return path


def _entries(path: Path) -> list[tuple[str, int, int]]:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, i.file_size, i.CRC) for i in zf.infolist()]


def test_client_state_item_is_added_and_everything_else_kept(pt_file):
    import torch

    before = torch.load(pt_file, weights_only=False)
    old_entries = _entries(pt_file)
    value = client_state_value(example())
    rewrite_pt_with_item(pt_file, CLIENT_STATE_KEY, value)
    after = torch.load(pt_file, weights_only=False)
    assert list(after) == list(before) + [CLIENT_STATE_KEY]
    assert after[CLIENT_STATE_KEY] == value
    for name, tensor in before["module"].items():
        assert torch.equal(after["module"][name], tensor) and after["module"][name].dtype == tensor.dtype
    assert after["param_shapes"] == before["param_shapes"]
    # torch.load's safe mode and mmap (which needs the 64-byte alignment) read it too.
    assert torch.load(pt_file, weights_only=True, mmap=True)[CLIENT_STATE_KEY] == value
    # Only data.pkl changed; every other record (name, size, CRC, order) is the same.
    new_entries = _entries(pt_file)
    assert [e for e in new_entries if not e[0].endswith("data.pkl")] == [
        e for e in old_entries if not e[0].endswith("data.pkl")
    ]
    assert all(
        offset % 64 == 0
        for member, (offset, _) in torchfile.zip_member_locations(pt_file).items()
        if "/data/" in member
    )
    # The restricted unpickler reads the manifest as a plain str.
    copy_ = read_client_state_copy(pt_file)
    assert copy_.kind == "client_state" and copy_.document == layout_document(example())
    assert [p.name for p in pt_file.parent.iterdir()] == [pt_file.name]


def test_embedding_the_same_value_again_changes_nothing(pt_file):
    value = client_state_value(example())
    rewrite_pt_with_item(pt_file, CLIENT_STATE_KEY, value)
    once = pt_file.read_bytes()
    rewrite_pt_with_item(pt_file, CLIENT_STATE_KEY, value)
    assert pt_file.read_bytes() == once
    other = example()
    other["layout"]["world_size"] = 4
    rewrite_pt_with_item(pt_file, CLIENT_STATE_KEY, client_state_value(other))
    assert read_client_state_copy(pt_file).document["layout"]["world_size"] == 4


@pytest.mark.parametrize("case", ["list", "protocol4", "compressed"])
def test_files_that_cannot_carry_the_manifest_are_left_untouched(tmp_path, case):
    import torch

    path = tmp_path / "x.pt"
    if case == "list":
        torch.save([torch.zeros(2)], path)
    elif case == "protocol4":
        torch.save({"a": torch.zeros(2)}, path, pickle_protocol=4)
    else:
        torch.save({"a": torch.zeros(2)}, tmp_path / "plain.pt")
        with zipfile.ZipFile(tmp_path / "plain.pt") as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                zout.writestr(info.filename, zin.read(info.filename))
        (tmp_path / "plain.pt").unlink()
    original = path.read_bytes()
    with pytest.raises(EmbedError) as info:
        rewrite_pt_with_item(path, CLIENT_STATE_KEY, "{}")
    assert info.value.code in ("CK305", "CK205") and info.value.exit_code == 1
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_unreadable_client_state_is_ck302(run, tmp_path):
    import torch

    for name, value in [("notstr.pt", {"a": 1}), ("garbage.pt", "{not json"), ("array.pt", "[1, 2]")]:
        torch.save({CLIENT_STATE_KEY: value}, tmp_path / name)
        with pytest.raises(EmbedError) as info:
            read_client_state_copy(tmp_path / name)
        assert info.value.code == "CK302", name
        result = run("extract", str(tmp_path / name))
        assert result.returncode == 1 and "CK302" in result.stderr and "Traceback" not in result.stderr


def test_extract_from_a_pt_without_manifest_is_ck303(run, pt_file):
    result = run("extract", str(pt_file))
    assert result.returncode == 1
    assert (
        result.stderr
        == f"{pt_file}: CK303 no embedded manifest found (hint: add one with `ckptspec embed CHECKPOINT`, "
        "or save with ckptspec.deepspeed.save_checkpoint)\n"
    )


def test_hostile_pickle_is_refused_not_run(tmp_path):
    import torch

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"module": {}, "x": Evil()}, tmp_path / "evil.pt")
    for action in (
        lambda: read_client_state_copy(tmp_path / "evil.pt"),
        lambda: rewrite_pt_with_item(tmp_path / "evil.pt", CLIENT_STATE_KEY, "{}"),
    ):
        with pytest.raises(Exception) as info:
            action()
        assert getattr(info.value, "code", None) == "CK204"
    assert not marker.exists()


# --------------------------------------------------------------------------- safetensors __metadata__


def write_safetensors(path: Path, metadata: dict[str, str] | None) -> None:
    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + struct.pack("<2f", 1.0, 2.0))


def test_safetensors_metadata_value_is_the_compact_canonical_json():
    meta = safetensors_metadata(example())
    text = meta[SAFETENSORS_KEY]
    assert json.loads(text) == example()
    assert "\n" not in text and ": " not in text and ", " not in text  # compact: a header is not for reading
    assert meta[SAFETENSORS_SHA256_KEY] == hashlib.sha256(text.encode()).hexdigest()


def test_extract_from_safetensors(run, tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"format": "pt", **safetensors_metadata(example())})
    result = run("extract", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.encode() == dumps(example(), "json")
    # The safetensors library agrees the file is fine.
    import safetensors

    with safetensors.safe_open(str(path), "np") as fh:
        assert json.loads(fh.metadata()[SAFETENSORS_KEY]) == example()


def test_safetensors_problems(run, tmp_path):
    meta = safetensors_metadata(example())
    assert '"world_size":2' in meta[SAFETENSORS_KEY]
    tampered = dict(meta, **{SAFETENSORS_KEY: meta[SAFETENSORS_KEY].replace('"world_size":2', '"world_size":3')})
    write_safetensors(tmp_path / "tampered.safetensors", tampered)
    write_safetensors(tmp_path / "none.safetensors", {"format": "pt"})
    write_safetensors(tmp_path / "nometa.safetensors", None)
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    expect = {
        "tampered": (1, "CK302 'ckptspec.manifest' does not match"),
        "none": (1, "CK303"),
        "nometa": (1, "CK303"),
        "short": (1, "CK302 not a safetensors file"),
        "huge": (1, "CK302 not a safetensors file"),
    }
    for stem, (code, text) in expect.items():
        result = run("extract", str(tmp_path / f"{stem}.safetensors"))
        assert result.returncode == code and text in result.stderr, (stem, result.stderr)


def test_directory_of_safetensors_shards(run, tmp_path):
    for i in (1, 2):
        write_safetensors(tmp_path / f"model-0000{i}-of-00002.safetensors", safetensors_metadata(example()))
    listed = run("extract", str(tmp_path), "--list")
    assert listed.returncode == 0 and listed.stdout.endswith(f"{tmp_path}: 2 copies agree\n")
    other = example()
    other["groups"][0]["params"][0]["name"] = "embedding.weight"
    other["aliases"][0]["owner"] = "embedding.weight"
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", safetensors_metadata(other))
    result = run("extract", str(tmp_path))
    assert result.returncode == 1 and result.stdout == ""
    assert "model-00002-of-00002.safetensors: $.aliases[0].owner: CK301 embedded copies disagree" in result.stderr


# --------------------------------------------------------------------------- agreement


def _copy(doc, kind="client_state", source="x.pt"):
    return EmbeddedCopy(source, kind, doc)


def test_copies_agree_when_only_producer_and_files_differ():
    full = example()
    layout_only = layout_document(full)
    layout_only["producer"]["tool"] = "someone-else"
    assert agreement_findings([_copy(full, "sidecar", "ckptspec.json"), _copy(layout_only)]) == []


def test_disagreement_names_the_copy_and_the_first_difference():
    full = example()
    other = layout_document(full)
    other["layout"]["world_size"] = 3
    findings = agreement_findings(
        [
            _copy(other, source="tag/zero_pp_rank_1_mp_rank_00_model_states.pt"),
            _copy(full, "sidecar", "tag/ckptspec.json"),
        ]
    )
    assert [f.to_line() for f in findings] == [
        "tag/zero_pp_rank_1_mp_rank_00_model_states.pt: $.layout.world_size: CK301 embedded copies disagree: this "
        "client-state copy says 3, the sidecar ckptspec.json says 2 (hint: copies of a manifest must describe the same "
        "layout; re-embed one manifest everywhere with `ckptspec embed CHECKPOINT --manifest M`)"
    ]


def test_first_difference():
    assert first_difference({"a": [1, 2]}, {"a": [1, 2.0]}) is None  # 2 and 2.0: the same count
    assert first_difference({"a": True}, {"a": 1}) == ("$.a", "true", "1")
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == ("$.a", "1 entries", "2 entries")
    assert first_difference({"a": 1}, {"b": 1}) == ("$.a", "1", "<absent>")
    assert first_difference({"a": 1, "opt": 2}, {"a": 1}, lenient=True) is None


def test_sidecar_of_one_encoding_replaces_the_other(tmp_path):
    write_sidecar(tmp_path, example(), "msgpack")
    write_sidecar(tmp_path, example(), "json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckptspec.json"]
    assert (tmp_path / "ckptspec.json").read_bytes() == dumps(example(), "json")
    write_sidecar(tmp_path, example(), "msgpack")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckptspec.msgpack"]


def test_extract_of_a_manifest_file_applies_the_version_gate(run, tmp_path):
    corpus = ROOT / "tests" / "conformance" / "1.0"
    newer = run("extract", str(corpus / "valid" / "newer-minor-1.4.0-unknown-fields.json"))
    assert newer.returncode == 0 and "CK004 warning:" in newer.stderr and '"format_version": "1.4.0"' in newer.stdout
    major = run("extract", str(corpus / "invalid" / "CK003-format-major-2.json"))
    assert major.returncode == 1 and "CK003" in major.stderr and major.stdout == ""
    assert run("extract", str(tmp_path / "missing")).returncode == 2


# --------------------------------------------------------------------------- real DeepSpeed: save_checkpoint


@pytest.fixture(scope="module", params=scenarios.EMBED)
def saved(request, ds):
    save_dir = ds.path(request.param)
    info = json.loads((save_dir / "harness.json").read_text())
    spec, world_size = info["spec"], info["world_size"]
    tag_dir = save_dir / (save_dir / "latest").read_text()
    returned = [json.loads((save_dir / f"saved_manifest.rank{r}.json").read_text()) for r in range(world_size)]
    return SimpleNamespace(
        name=request.param,
        save_dir=save_dir,
        tag_dir=tag_dir,
        world_size=world_size,
        spec=spec,
        returned=returned,
        sidecar=tag_dir / "ckptspec.json",
    )


def _model_files(tag_dir: Path) -> list[Path]:
    return sorted(p for p in tag_dir.iterdir() if p.name.endswith("model_states.pt"))


def _without(doc: dict, *keys: str) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


def _without_digests(doc: dict) -> dict:
    """The document without format 1.1's tensor digests (computed from the files once they are written)."""
    doc = json.loads(json.dumps(doc))
    for item in [p for g in doc["groups"] for p in g["params"]] + doc["frozen"] + doc["buffers"]:
        for key in ("digest", "model_digest", "state_digests"):
            item.pop(key, None)
    return doc


def test_every_rank_returns_the_same_complete_valid_manifest(saved):
    assert all(doc == saved.returned[0] for doc in saved.returned)
    manifest = saved.returned[0]
    assert validate_document(manifest).findings == []
    assert {f["path"] for f in manifest["files"]} == {
        p.name for p in saved.tag_dir.iterdir() if p.name != "ckptspec.json"
    }
    assert all(f["hash"]["algorithm"] == "sha256" for f in manifest["files"])
    if saved.spec.get("exclude_frozen"):
        assert manifest["excluded"] and manifest["frozen"] == []
    # Format 1.1: the live engine's optimizer class and scalars, a save id, every tensor digested.
    assert manifest["format_version"] == "1.1.0" and manifest["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert len(manifest["save"]["id"]) == 36 and manifest["save"]["global_steps"] == saved.spec["steps"]
    tensors = [p for g in manifest["groups"] for p in g["params"]] + manifest["frozen"] + manifest["buffers"]
    assert tensors and all("digest" in t for t in tensors)


def test_sidecar_is_written_last_and_latest_after_it(saved):
    assert saved.sidecar.read_bytes() == dumps(saved.returned[0], "json")
    sidecar_time = saved.sidecar.stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= sidecar_time for p in saved.tag_dir.iterdir())
    assert (saved.save_dir / "latest").stat().st_mtime_ns >= sidecar_time
    leftovers = [p for d in (saved.save_dir, saved.tag_dir) for p in d.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_the_tag_directory_gets_the_mode_of_the_directories_the_job_made(saved):
    """#37 item 7 (M3): was drwx------ whatever the umask (a temporary directory renamed into place),
    where DeepSpeed's own saves are drwxr-xr-x under umask 022: the job made the save directory
    under the same umask."""
    assert stat.S_IMODE(saved.tag_dir.stat().st_mode) == stat.S_IMODE(saved.save_dir.stat().st_mode)


def test_sidecar_files_are_the_files_on_disk(run, saved):
    """Sizes, hashes and locators gathered from the ranks equal what the saved directory says
    (so the model-states files were described with their client state inside)."""
    from ckptspec.deepspeed.describe import describe

    from_dir = describe(saved.save_dir, hash_algorithm="sha256").to_dict()
    sidecar = json.loads(saved.sidecar.read_text())
    assert from_dir["files"] == sidecar["files"]
    # The directory producer ignores the ckptspec_manifest client key and agrees on the layout.
    assert _without(from_dir, "producer", "files", "excluded") == _without(sidecar, "producer", "files", "excluded")
    checked = run("validate", str(saved.save_dir))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_model_states_carry_the_layout_manifest(saved):
    sidecar = json.loads(saved.sidecar.read_text())
    files = _model_files(saved.tag_dir)
    assert len(files) == (saved.world_size if saved.spec["stage"] == 3 else 1)
    for path in files:
        state = torchfile.read_pt_metadata(path)
        assert type(state[CLIENT_STATE_KEY]) is str
        # Everything but the files and what is computed from them once written (the digests): the save id too.
        assert json.loads(state[CLIENT_STATE_KEY]) == _without_digests(layout_document(sidecar))
    assert embedded_findings(saved.save_dir) == []


def test_engine_load_checkpoint_still_works(saved):
    sidecar = json.loads(saved.sidecar.read_text())
    for rank in range(saved.world_size):
        result = json.loads((saved.save_dir / f"load_back.rank{rank}.json").read_text())
        assert result["moved_before_load"], "the extra step did not change the weights: the test proves nothing"
        assert result["restored"], f"rank {rank}: weights after load_checkpoint differ from the saved ones"
        assert result["embedded_type"] == "str" and result["embedded"] == _without_digests(layout_document(sidecar))


def test_manifest_survives_when_only_pt_files_are_copied(run, saved, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in saved.tag_dir.glob("*.pt"):
        shutil.copy2(path, bare / path.name)
    sidecar = json.loads(saved.sidecar.read_text())
    result = run("extract", str(bare))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == _without_digests(layout_document(sidecar))
    one = run("extract", str(_model_files(bare)[-1]))
    assert json.loads(one.stdout) == _without_digests(layout_document(sidecar))
    # embed restores the complete sidecar from the copies: the engine's layout (the optimizer's class
    # and the save id included), files described and tensors digested anew.
    restored = run("embed", str(bare))
    assert restored.returncode == 0, restored.stderr
    assert json.loads((bare / "ckptspec.json").read_text()) == sidecar


def test_extract_prints_the_sidecar_and_lists_agreeing_copies(run, saved):
    result = run("extract", str(saved.save_dir))
    assert result.returncode == 0 and result.stdout.encode() == saved.sidecar.read_bytes()
    listed = run("extract", str(saved.save_dir), "--list")
    n = len(_model_files(saved.tag_dir)) + 1
    assert listed.returncode == 0 and listed.stdout.endswith(f"{saved.save_dir}: {n} copies agree\n")


def test_disagreeing_copy_is_reported(run, saved, tmp_path):
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved.save_dir, copy_dir)
    tag_dir = copy_dir / saved.tag_dir.name
    victim = _model_files(tag_dir)[-1]
    doc = json.loads(saved.sidecar.read_text())
    doc["groups"][0]["params"][0]["shape"] = list(reversed(doc["groups"][0]["params"][0]["shape"]))
    rewrite_pt_with_item(victim, CLIENT_STATE_KEY, client_state_value(doc))
    result = run("extract", str(copy_dir))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{victim}: $.groups[0].params[0].shape" in result.stderr and "CK301" in result.stderr
    assert [f.code for f in embedded_findings(copy_dir)] == ["CK301"]


def test_embed_into_a_plain_deepspeed_checkpoint(run, saved, tmp_path):
    """Strip every copy, then `ckptspec embed` puts them back: client state first, sidecar last."""
    import torch

    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved.save_dir, copy_dir)
    tag_dir = copy_dir / saved.tag_dir.name
    (tag_dir / "ckptspec.json").unlink()
    for path in _model_files(tag_dir):
        state = torch.load(path, weights_only=False)
        del state[CLIENT_STATE_KEY]
        torch.save(state, path)
    assert run("extract", str(copy_dir)).returncode == 1  # CK303: nothing left

    result = run("embed", str(copy_dir))
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.splitlines()[-1]
        == f"{tag_dir / 'ckptspec.json'}: written ({len(saved.returned[0]['files'])} files)"
    )
    sidecar, original = json.loads((tag_dir / "ckptspec.json").read_text()), saved.returned[0]
    # The directory cannot know the names exclude_frozen_parameters dropped, the optimizer's class
    # nor the save id (both were only in the stripped copies); the rest is the engine's manifest.
    assert sidecar["optimizer"].pop("class") == "unknown" and "id" not in sidecar["save"]
    known = json.loads(json.dumps(original))
    known["optimizer"].pop("class"), known["save"].pop("id")
    assert _without(sidecar, "producer", "files", "excluded") == _without(known, "producer", "files", "excluded")
    assert run("validate", str(copy_dir)).returncode == 0
    assert embedded_findings(copy_dir) == []

    # --manifest with the engine's manifest: it describes this checkpoint's layout, but it records the
    # model states the hook saved (the manifest pickled inside), not the ones re-saved above: refused
    # (#37, nothing written) until --rehash records them as they are; then kept as given.
    given = tmp_path / "engine.json"
    given.write_bytes(saved.sidecar.read_bytes())
    refused = run("embed", str(copy_dir), "--manifest", str(given), "--encoding", "msgpack")
    assert refused.returncode == 1 and not (tag_dir / "ckptspec.msgpack").exists()
    assert {name for name in (p.name for p in _model_files(tag_dir)) if f"{name}: $.files" in refused.stderr} == {
        p.name for p in _model_files(tag_dir)
    }
    assert "not embedded: the files do not match what the manifest given records" in refused.stderr
    again = run("embed", str(copy_dir), "--manifest", str(given), "--encoding", "msgpack", "--rehash")
    assert again.returncode == 0, again.stderr
    assert not (tag_dir / "ckptspec.json").exists()
    assert _without(load_document(tag_dir / "ckptspec.msgpack"), "files") == _without(original, "files")
    assert run("validate", str(copy_dir)).returncode == 0


def test_embed_over_a_flipped_master_bit_is_refused_until_rehash(run, saved, tmp_path):
    """#37 (H3), the report's repro on the hook's own sidecars: one bit of the last rank's fp32 master
    partition flipped (same size). `embed` and `embed --sidecar-only` used to record the damaged file,
    after which `validate` said valid; now they refuse, nothing written, until `--rehash`."""
    import torch

    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved.save_dir, copy_dir)
    tag_dir = copy_dir / saved.tag_dir.name
    sidecar = json.loads(saved.sidecar.read_text())
    entry = [f for f in sidecar["files"] if f["role"] == "optimizer_states"][-1]
    victim = tag_dir / entry["path"]
    key = "fp32_flat_groups" if saved.spec["stage"] == 3 else "single_partition_of_fp32_groups"
    before = torch.load(victim, map_location="cpu", weights_only=False)["optimizer_state_dict"][key][0]
    data = bytearray(victim.read_bytes())
    data[entry["partitions"][0]["data_offset"] + 4 * 3 + 2] ^= 0x10
    victim.write_bytes(bytes(data))
    after = torch.load(victim, map_location="cpu", weights_only=False)["optimizer_state_dict"][key][0]
    assert (after != before).nonzero().flatten().tolist() == [3]  # one master element, nothing else read differs
    files = {p.name: p.read_bytes() for p in tag_dir.iterdir()}

    for options in ([], ["--sidecar-only"]):
        result = run("embed", str(copy_dir), *options)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"{victim.name}: $.files[" in result.stderr and " CK209 " in result.stderr and " CK222 " in result.stderr
        assert "not embedded: the files do not match what ckptspec.json records" in result.stderr
        assert {p.name: p.read_bytes() for p in tag_dir.iterdir()} == files
    assert run("validate", str(copy_dir)).returncode == 1

    rehashed = run("embed", str(copy_dir), "--rehash")
    assert rehashed.returncode == 0 and "re-recorded from the files as they are now (CK209" in rehashed.stdout
    # Re-recorded hashes no longer flag the file, but the flipped master still differs from the module's
    # copy of that weight (cast to the run's dtype): CK235 (#39, every stored copy checked) refuses it.
    # ZeRO-3's model states hold no weight values (placeholders), so nothing is left to disagree there.
    after_rehash = run("validate", str(copy_dir))
    if saved.spec["stage"] == 3:
        assert after_rehash.returncode == 0, after_rehash.stdout
    else:
        assert after_rehash.returncode == 1 and " CK235 " in after_rehash.stdout + after_rehash.stderr


def test_embed_refuses_a_manifest_of_another_checkpoint(run, saved, ds, tmp_path):
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved.save_dir, copy_dir)
    before = {p.name: p.read_bytes() for p in (copy_dir / saved.tag_dir.name).iterdir()}
    # A valid manifest, of another real checkpoint: the layouts differ, so it does not describe this one.
    other = "s2-bf16-ws2" if saved.spec["stage"] != 2 else "s3-bf16-ws2-sub"
    path = tmp_path / "other.json"
    assert run("generate", str(ds.path(other)), "-o", str(path)).returncode == 0
    result = run("embed", str(copy_dir), "--manifest", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith(
        f"{copy_dir / saved.tag_dir.name}: CK304 the manifest does not describe"
    ), result.stderr
    assert {p.name: p.read_bytes() for p in (copy_dir / saved.tag_dir.name).iterdir()} == before


# --------------------------------------------------------------------------- save_checkpoint's failure paths (no job)


class _FakeDist:
    """torch.distributed for rank 0 of a job whose other ranks are simulated in-process."""

    def __init__(self, world: int, others):
        self.world, self.others = world, others

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self):
        return 0

    def get_world_size(self):
        return self.world

    def all_gather_object(self, out, obj):
        out[:] = [obj] + [self.others(r) for r in range(1, self.world)]

    def broadcast_object_list(self, box, src=0):
        pass


class _FakeEngine:
    """Saves by copying a real saved tag directory (and storing the client state like DeepSpeed)."""

    global_steps = 2

    def __init__(self, template: Path, decoupled: bool = False):
        self.template, self.calls, self.target = template, [], None
        self.checkpoint_engine = SimpleNamespace(is_decoupled=lambda: decoupled)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        self.calls.append(dict(tag=tag, save_latest=save_latest, keys=sorted(client_state)))
        target = self.target = Path(save_dir) / tag
        target.mkdir(parents=True, exist_ok=True)  # DeepSpeed's makedirs(exist_ok=True): the mode stays
        for path in self.template.iterdir():
            shutil.copy2(path, target / path.name)
        (target / "ckptspec.json").unlink()
        for path in _model_files(target):
            rewrite_pt_with_item(path, CLIENT_STATE_KEY, client_state[CLIENT_STATE_KEY])


@pytest.fixture
def fake_job(saved, monkeypatch):
    import torch.distributed

    import ckptspec.deepspeed.save.zero as ds
    from ckptspec.deepspeed import save_checkpoint
    from ckptspec.format.models import Manifest

    layout = Manifest.model_validate(_without_digests(layout_document(json.loads(saved.sidecar.read_text()))))
    monkeypatch.setattr(
        ds, "manifest_from_engine", lambda engine, exclude_frozen_parameters=False: layout.model_copy(deep=True)
    )
    # The save id rank 0 draws: the real job's, so that the sidecar can be reproduced byte for byte.
    monkeypatch.setattr(ds.uuid, "uuid4", lambda: uuid.UUID(layout.save.id))

    def install(other=None, hash_algorithm="sha256"):
        def others(rank):
            if other is not None:
                return other(rank)
            return ds._describe_own_files(state["engine"].target, rank, layout, hash_algorithm), None

        state = {}
        fake = _FakeDist(saved.world_size, others)
        for name in (
            "is_available",
            "is_initialized",
            "get_rank",
            "get_world_size",
            "all_gather_object",
            "broadcast_object_list",
        ):
            monkeypatch.setattr(torch.distributed, name, getattr(fake, name))
        return state

    def engine(state=None, **kw):
        made = _FakeEngine(saved.tag_dir, **kw)
        if state is not None:
            state["engine"] = made  # the simulated ranks describe what it wrote
        return made

    return SimpleNamespace(install=install, ds=ds, engine=engine, save_checkpoint=save_checkpoint)


def test_fake_job_reproduces_the_real_sidecar(fake_job, saved, tmp_path):
    state = fake_job.install()
    engine = fake_job.engine(state)
    manifest = fake_job.save_checkpoint(engine, tmp_path, client_state={"mine": 1})
    # DeepSpeed wrote into a temporary tag directory, which then took the tag's name.
    (call,) = engine.calls
    assert call["tag"].startswith(".global_step2.ckptspec-") and not (tmp_path / call["tag"]).exists()
    assert call == dict(tag=call["tag"], save_latest=False, keys=[CLIENT_STATE_KEY, "mine"])
    assert manifest.to_dict() == saved.returned[0]
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert (tmp_path / "global_step2" / "ckptspec.json").read_bytes() == saved.sidecar.read_bytes()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_the_published_tag_directory_honours_the_umask(fake_job, tmp_path, umask):
    """#37 item 7 (M3): the hook's staged tag directory (``staged_save.save_staged``) was mkdtemp's 0700."""
    state = fake_job.install()
    old = os.umask(umask)
    try:
        fake_job.save_checkpoint(fake_job.engine(state), tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "global_step2").stat().st_mode) == 0o777 & ~umask


def test_save_options(fake_job, saved, tmp_path):
    state = fake_job.install(hash_algorithm=None)
    manifest = fake_job.save_checkpoint(
        fake_job.engine(state), tmp_path, tag="mytag", hash=False, save_latest=False, sidecar_encoding="msgpack"
    )
    assert not (tmp_path / "latest").exists()
    assert sorted(p.name for p in (tmp_path / "mytag").iterdir() if p.name.startswith("ckptspec")) == [
        "ckptspec.msgpack"
    ]
    assert all(f.hash is None for f in manifest.files) and "hash" not in json.dumps(
        load_document(tmp_path / "mytag" / "ckptspec.msgpack")["files"]
    )


def test_refusals_before_anything_is_saved(fake_job, tmp_path):
    fake_job.install()
    with pytest.raises(ValueError, match="reserved"):
        fake_job.save_checkpoint(fake_job.engine(), tmp_path, client_state={CLIENT_STATE_KEY: "mine"})
    with pytest.raises(UnsupportedEngine, match="decoupled"):
        fake_job.save_checkpoint(fake_job.engine(decoupled=True), tmp_path)
    with pytest.raises(ValueError, match="sidecar_encoding"):
        fake_job.save_checkpoint(fake_job.engine(), tmp_path, sidecar_encoding="yaml")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "feature,config,named",
    [
        ("nvme-optimizer", {"zero_nvme_offload_optimizer": lambda: True}, "NVMe optimizer offload"),
        (
            "nvme-param",
            {"_config": SimpleNamespace(zero_config=SimpleNamespace(offload_param=SimpleNamespace(device="nvme")))},
            "NVMe parameter offload",
        ),
        ("zeropp-quantized", {"zero_quantized_nontrainable_weights": lambda: True}, "zero_quantized_nontrainable"),
        ("autoep", {"_config": SimpleNamespace(expert_parallel_config=SimpleNamespace(enabled=True))}, "AutoEP"),
    ],
)
@pytest.mark.parametrize(
    "kind",
    [
        {},  # data parallel: a manifest
        {"mp_world_size": 2},  # tensor/pipeline parallel: an index (engine_index_save.py)
        {"has_moe_layers": True},  # MoE: an index locating masters (engine_masters_save.py)
        {"zero_optimization_stage": lambda: 0},  # ZeRO stage 0: likewise
    ],
    ids=["data-parallel", "model-parallel", "moe", "stage0"],
)
def test_engines_a_manifest_cannot_describe_are_refused_before_saving(fake_job, tmp_path, feature, config, named, kind):
    """#17: the save hook names the feature and DeepSpeed writes nothing, whatever describes the engine
    (the engine's accessors are DeepSpeed 0.19.8's: ``zero_nvme_offload_optimizer``,
    ``zero_config.offload_param``, ``zero_quantized_nontrainable_weights``, ``expert_parallel_config``;
    NVMe and ZeRO++ quantized weights need a build and a GPU this machine has not)."""
    fake_job.install()
    engine = fake_job.engine()
    for key, value in {**kind, **config}.items():
        setattr(engine, key, value)
    with pytest.raises(UnsupportedEngine, match=named):
        fake_job.save_checkpoint(engine, tmp_path)
    assert engine.calls == [] and list(tmp_path.iterdir()) == []


def test_a_rank_that_cannot_describe_its_files_fails_every_rank(fake_job, tmp_path):
    fake_job.install(other=lambda rank: ([], f"rank {rank}: OSError: disk gone"))
    with pytest.raises(RuntimeError, match="rank 1: OSError: disk gone"):
        fake_job.save_checkpoint(fake_job.engine(), tmp_path)
    assert not (tmp_path / "latest").exists() and not (tmp_path / "global_step2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a temporary tag directory is left"


def test_an_incomplete_checkpoint_gets_no_sidecar_and_no_latest(fake_job, tmp_path):
    fake_job.install(other=lambda rank: ([], None))  # the other ranks' files are missing from the manifest
    with pytest.raises(RuntimeError, match="could not write the manifest sidecar"):
        fake_job.save_checkpoint(fake_job.engine(), tmp_path)
    assert not (tmp_path / "latest").exists() and not (tmp_path / "global_step2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a temporary tag directory is left"


def test_validate_dir_reports_a_disagreeing_copy(run, saved, tmp_path):
    """`ckptspec validate DIR` checks the embedded copies too (CK301), file named."""
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved.save_dir, copy_dir)
    tag_dir = copy_dir / saved.tag_dir.name
    victim = _model_files(tag_dir)[0]
    doc = json.loads(saved.sidecar.read_text())
    doc["layout"]["world_size"] += 1
    rewrite_pt_with_item(victim, CLIENT_STATE_KEY, client_state_value(doc))
    result = run("validate", str(copy_dir), "--no-hash")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert "CK301" in result.stdout and victim.name in result.stdout


def test_digests_need_every_file_on_rank_0(fake_job, tmp_path, monkeypatch):
    """A digest can span ranks' files: when rank 0 cannot see one (no shared filesystem), the sidecar
    keeps the files' hashes and records no digest, with a warning; the save still succeeds."""
    state = fake_job.install()
    monkeypatch.setattr(fake_job.ds, "_sees_every_file", lambda tag_dir, manifest: False)
    with pytest.warns(UserWarning, match="rank 0 cannot see every saved file; no tensor digests"):
        manifest = fake_job.save_checkpoint(fake_job.engine(state), tmp_path)
    doc = manifest.to_dict()
    assert all("hash" in f for f in doc["files"])
    assert "digest" not in json.dumps(doc["groups"] + doc["frozen"] + doc["buffers"])
    assert (tmp_path / "latest").read_text() == "global_step2"


def test_a_digest_that_cannot_be_computed_fails_every_rank(fake_job, tmp_path, monkeypatch):
    state = fake_job.install()

    def broken(manifest, tag_dir):
        raise OSError("disk gone")

    monkeypatch.setattr(fake_job.ds, "add_digests", broken)
    with pytest.raises(RuntimeError, match="could not digest the saved tensors .* rank 0: OSError: disk gone"):
        fake_job.save_checkpoint(fake_job.engine(state), tmp_path)
    assert not (tmp_path / "latest").exists() and not (tmp_path / "global_step2" / "ckptspec.json").exists()
