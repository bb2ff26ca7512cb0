"""Issue #37 (H3, M5): what a checkpoint records of its files is neither laundered nor misread.

H3: `embed` (and `migrate --checkpoint`) over files that no longer match their record (a flipped bit
in a master partition) rewrote the record from the damaged files, and `validate` then said valid.
Now the files are checked against every record being replaced first, and only `--rehash` records
them as they are. M5: a `generate --hash` manifest kept from before `embed` (the guide's steps) made
`validate --checkpoint` say the model states were truncated, "restore it": the file is the recorded
one plus the embedded manifest (rebuilt without it, the same bytes), so the manifest is stale (CK227).

Real DeepSpeed checkpoints committed to the repository (0.19.8 ZeRO-2, 0.15.4 ZeRO-1 and ZeRO-3):
no job to run. The oracles are hashlib over the files, torch.load and zipfile.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.checkpoint import torchfile
from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests" / "data" / "deepspeed-0.15.4"
TAG = "global_step2"
OPT1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
SOURCES = {
    "0.19.8-s2": COMMITTED["s2-bf16-ws2"],
    "0.15.4-s3": OLD / "old-s3-bf16-ws2",
    "0.15.4-s1": OLD / "old-s1-bf16-ws2",
}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr, result.output + result.stderr
    return result


def findings(*args) -> tuple[int, list[dict]]:
    result = run(*args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)["findings"]


def contents(tag_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir())}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A scratch copy of a real DeepSpeed ZeRO-2 bf16 save directory (DeepSpeed 0.19.8, 2 ranks)."""
    dest = tmp_path / "ckpt"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], dest)
    return dest


def flip_a_master_bit(path: Path) -> None:
    """One bit inside the fp32 master partition (`single_partition_of_fp32_groups`), same size: only the
    recorded hash and digests can tell. torch.load confirms that the partition, and only it, changed."""
    import torch

    before = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    state = torchfile.read_pt_metadata(path)
    ref = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    offset, _ = torchfile.tensor_byte_range(ref, torchfile.zip_member_locations(path))
    with open(path, "r+b") as fh:
        fh.seek(offset + 4 * 7 + 1)
        byte = fh.read(1)
        fh.seek(offset + 4 * 7 + 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    after = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    changed = after["single_partition_of_fp32_groups"][0] != before["single_partition_of_fp32_groups"][0]
    assert changed.nonzero().flatten().tolist() == [7]
    assert all(
        torch.equal(after["base_optimizer_state"]["state"][0][k], v)
        for k, v in before["base_optimizer_state"]["state"][0].items()
    )


def _local_extra(path: Path, info: zipfile.ZipInfo) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 28)
        extra_len = int.from_bytes(fh.read(2), "little")
        fh.seek(info.header_offset + 30 + len(info.filename.encode()))
        return fh.read(extra_len)


# --------------------------------------------------------------------------- H3: embed over changed files


@pytest.mark.parametrize("options", [[], ["--sidecar-only"], ["--no-hash"]], ids=["embed", "sidecar-only", "no-hash"])
def test_embed_refuses_to_record_damaged_files_over_their_record(ckpt, options):
    assert run("embed", ckpt).exit_code == 0
    tag_dir = ckpt / TAG
    flip_a_master_bit(tag_dir / OPT1)
    code, found = findings("validate", ckpt)
    assert code == 1 and [(f["code"], f.get("file")) for f in found] == [("CK209", OPT1), ("CK222", None)]
    before = contents(tag_dir)

    result = run("embed", ckpt, *options)
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"{OPT1}: $.files[2].hash (rank 1): CK209 ") and " CK222 " in lines[1]
    assert lines[-1] == (
        f"{ckpt}: not embedded: the files do not match what ckptspec.json records; nothing was written "
        "(hint: restore the files the record describes; if they changed on purpose, record them as they "
        f"are now with `ckptspec embed {ckpt} --rehash`)"
    )
    assert result.stdout == ""
    assert contents(tag_dir) == before, "a refused embed wrote something"
    assert findings("validate", ckpt) == (code, found)  # still caught
    assert run("reconstruct", ckpt, ckpt.parent / "out").exit_code == 1


def test_rehash_records_the_files_as_they_are_and_says_so(ckpt):
    assert run("embed", ckpt).exit_code == 0
    tag_dir = ckpt / TAG
    flip_a_master_bit(tag_dir / OPT1)

    result = run("embed", ckpt, "--rehash")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0].startswith(f"{OPT1}: $.files[2].hash (rank 1): CK209 ")
    assert result.stdout.splitlines()[-1] == (
        f"{tag_dir / 'ckptspec.json'}: written (3 files; re-recorded from the files as they are now "
        "(CK209, CK222 against the previous record))"
    )
    sidecar = json.loads((tag_dir / "ckptspec.json").read_text())
    recorded = next(f for f in sidecar["files"] if f["path"] == OPT1)["hash"]["digest"]
    assert recorded == hashlib.sha256((tag_dir / OPT1).read_bytes()).hexdigest()
    assert run("validate", ckpt).exit_code == 0  # what the user asked for, explicitly


def test_embed_checks_the_files_against_a_manifest_given(ckpt, tmp_path):
    """`embed --manifest M` keeps M's layout and describes the files anew: M's hashes are checked first."""
    manifest = tmp_path / "manifest.json"
    assert run("generate", ckpt, "--hash", "-o", manifest).exit_code == 0
    flip_a_master_bit(ckpt / TAG / OPT1)
    before = contents(ckpt / TAG)

    result = run("embed", ckpt, "--manifest", manifest)
    assert result.exit_code == 1 and f"{OPT1}: $.files[2].hash (rank 1): CK209 " in result.stderr
    assert "not embedded: the files do not match what the manifest given records" in result.stderr
    assert contents(ckpt / TAG) == before
    assert run("embed", ckpt, "--manifest", manifest, "--rehash").exit_code == 0


def test_embedding_a_kept_manifest_again_is_not_a_mismatch(ckpt, tmp_path):
    """After `embed --manifest M`, M predates the embed (CK227): that is no damage, `embed` goes on."""
    manifest = tmp_path / "manifest.json"
    assert run("generate", ckpt, "--hash", "-o", manifest).exit_code == 0
    assert run("embed", ckpt, "--manifest", manifest).exit_code == 0
    again = run("embed", ckpt, "--manifest", manifest, "--encoding", "msgpack")
    assert again.exit_code == 0, again.output
    assert run("validate", ckpt).exit_code == 0


def test_migrate_checkpoint_refuses_to_fill_digests_from_changed_files(ckpt, tmp_path):
    """`migrate --to 1.1 --checkpoint` adds digests read from the files: not from files that no
    longer have the hashes the 1.0 manifest records."""
    manifest, old, out = tmp_path / "m.json", tmp_path / "m10.json", tmp_path / "m11.json"
    assert run("generate", ckpt, "--hash", "-o", manifest).exit_code == 0
    assert run("migrate", manifest, old, "--to", "1.0").exit_code == 0
    assert run("migrate", old, out, "--to", "1.1", "--checkpoint", ckpt).exit_code == 0
    out.unlink()
    flip_a_master_bit(ckpt / TAG / OPT1)

    result = run("migrate", old, out, "--to", "1.1", "--checkpoint", ckpt)
    assert result.exit_code == 1 and f"{OPT1}: $.files[2].hash (rank 1): CK209 " in result.stderr
    assert f"{ckpt}: not migrated: the files do not match what the manifest records; nothing was written" in (
        result.stderr
    )
    assert not out.exists()


def test_embed_into_a_model_states_file_with_a_damaged_record_is_ck205(ckpt):
    """Nothing recorded to check against, but the zip's own CRC-32 of the record: CK205, not CK999."""
    path = ckpt / TAG / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(_local_extra(path, info))
    data = bytearray(path.read_bytes())
    data[start + 100] ^= 0x01
    path.write_bytes(bytes(data))
    before = contents(ckpt / TAG)

    result = run("embed", ckpt)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"{path}: CK205 the file is damaged: Bad CRC-32 for file '{info.filename}'")
    assert contents(ckpt / TAG) == before


# --------------------------------------------------------------------------- M5: a manifest from before embed


@pytest.mark.parametrize("hashes", [True, False], ids=["hash", "no-hash"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_manifest_kept_from_before_embed_is_stale_not_damage(source, hashes, tmp_path):
    """The guide's steps: `generate --hash -o M`, keep M, `embed`, then `validate M --checkpoint`."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SOURCES[source], ckpt)
    tag_dir = ckpt / TAG
    models = sorted(p.name for p in tag_dir.glob("*model_states.pt"))
    manifest = tmp_path / "manifest.json"
    assert run("generate", ckpt, *(["--hash"] if hashes else []), "-o", manifest).exit_code == 0
    recorded = {f["path"]: f for f in json.loads(manifest.read_text())["files"]}
    assert run("embed", ckpt).exit_code == 0
    assert all((tag_dir / name).stat().st_size > recorded[name]["size"] for name in models)  # embed rewrote them

    code, found = findings("validate", manifest, "--checkpoint", ckpt)
    assert code == 1
    assert [(f["code"], f["file"]) for f in found] == [("CK227", name) for name in models]
    proof = "sha256" if hashes else "size"
    for f in found:
        assert f"without it, it is the recorded file (same {proof})" in f["message"]
        assert "ckptspec extract CHECKPOINT -o manifest.json" in f["hint"] and "restore" not in f["hint"]

    fresh = tmp_path / "fresh.json"
    assert run("extract", ckpt, "-o", fresh).exit_code == 0
    assert findings("validate", fresh, "--checkpoint", ckpt) == (0, [])


def test_a_model_states_file_changed_before_the_embed_is_still_damage(ckpt, tmp_path):
    """A file really replaced (re-saved by torch with one frozen weight changed), then embedded: rebuilt
    without the embedded manifest it is not the recorded file, so it is damage (CK208), "restore it"."""
    import torch

    manifest = tmp_path / "manifest.json"
    assert run("generate", ckpt, "--hash", "-o", manifest).exit_code == 0
    path = ckpt / TAG / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["module"]["frozen.weight"][0, 0] += 1
    torch.save(state, path)
    assert run("embed", ckpt).exit_code == 0

    code, found = findings("validate", manifest, "--checkpoint", ckpt)
    assert code == 1 and "CK227" not in {f["code"] for f in found}
    size = next(f for f in found if f["code"] == "CK208")
    assert size["file"] == path.name and size["hint"].endswith("restore it")
    assert "without the manifest `ckptspec embed` added to it, it is still not the recorded file" in size["message"]


def resave_everything(tag_dir: Path) -> None:
    """The tag saved again without ckptspec, one step later: DeepSpeed rewrites every file, the sidecar stays."""
    import torch

    for path in sorted(tag_dir.glob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if "optimizer_state_dict" in state:
            with torch.no_grad():  # a moment moved (the masters, and so the module's copies, kept: CK235 agrees)
                state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][0] += 1
        else:
            state.pop("ckptspec_manifest")
            state["global_steps"] += 1
        torch.save(state, path)


def test_a_sidecar_of_another_save_is_not_called_damage(ckpt):
    assert run("embed", ckpt).exit_code == 0
    resave_everything(ckpt / TAG)

    code, found = findings("validate", ckpt)
    differ = [f for f in found if f["code"] in ("CK208", "CK209")]
    assert code == 1 and {f["file"] for f in differ} == {p.name for p in (ckpt / TAG).glob("*.pt")}
    for f in differ:
        assert f["hint"].startswith("every file differs from its record") and "--rehash" in f["hint"]
    assert run("embed", ckpt).exit_code == 1  # still refused: which save is right is the user's call
    assert run("embed", ckpt, "--rehash").exit_code == 0
    assert run("validate", ckpt).exit_code == 0


def test_one_changed_file_is_still_to_be_restored(ckpt):
    assert run("embed", ckpt).exit_code == 0
    flip_a_master_bit(ckpt / TAG / OPT1)
    _, found = findings("validate", ckpt)
    assert next(f for f in found if f["code"] == "CK209")["hint"].endswith("restore it")
