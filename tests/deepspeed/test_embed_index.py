"""``embed --sidecar-only`` of the kinds a checkpoint index describes: AutoTP, pipeline, tensor x pipeline, MoE,
ZeRO stage 0 (and its pipeline), on real DeepSpeed 0.19.8 saves (tests/_harness/scenarios.py).

The sidecar is the index ``generate --hash`` writes, byte for byte, added beside the files under a temporary name and
renamed (nothing else changes, nothing is left behind, stopped anywhere: no sidecar or the whole one); ``validate``,
``validate SIDECAR --checkpoint`` and ``extract --list`` then read it. What the tag records already is checked first,
as the plain embed checks it: a bit flipped in a shard after the index was recorded is refused (exit 1, nothing
written) unless ``--rehash``; a document given of another layout is CK304. Without ``--sidecar-only``: CK202, the hint
naming it. The oracles: the bytes of the files, ``generate``'s output, hashlib.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _harness.faults import flip_a_byte
from _harness.scenarios import COMMITTED, hook_name
from _harness.states import hidden, points
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.format.codec import dumps

KINDS = {
    "autotp-tp2": "tp2-s1-fp32-ws2",
    "pipeline-pp2": "pp2-s1-fp32-ws2",
    "tp2xpp2": "tp2pp2-s1-fp32-ws4",
    "moe-ep2": "moe-ep2-s1-fp32-ws2",
    "stage0": "s0-bf16-ws2",
    "pipeline-stage0": "pp2-s0-bf16-ws2",
}
REHASH_HINT = (
    "(hint: restore the files the record describes; if they changed on purpose, record them as they are now with "
    "`ckptspec embed {} --rehash`)"
)


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr, result.output + result.stderr
    return result


def contents(tag_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir())}


def copy_of(ds, name: str, tmp_path: Path, sidecar: bool = False) -> tuple[Path, Path]:
    """(a scratch copy of the save directory, its tag directory): a sidecar there only if ``sidecar`` (the hook's)."""
    copy = tmp_path / name
    shutil.copytree(ds.path(name), copy)
    tag_dir = copy / (copy / "latest").read_text().strip()
    assert [p.name for p in tag_dir.glob("ckptspec.*")] == (["ckptspec.json"] if sidecar else [])
    return copy, tag_dir


def flip_a_bit(path: Path) -> None:
    path.write_bytes(flip_a_byte(path.read_bytes()))


@pytest.mark.parametrize("name", KINDS.values(), ids=KINDS.keys())
def test_sidecar_only_writes_the_index_generate_writes(ds, name, tmp_path):
    copy, tag_dir = copy_of(ds, name, tmp_path)
    before = contents(tag_dir)
    refused = run("embed", copy)  # the model states cannot carry an index: refused by name, the hint says what does
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"{tag_dir}: CK202 embed writes a layout manifest into the model-states files")
    assert f"(hint: write the checkpoint index as the sidecar: `ckptspec embed {copy} --sidecar-only`" in refused.stderr
    assert contents(tag_dir) == before

    assert run("generate", copy, "--hash", "-o", tmp_path / "generated.json").exit_code == 0
    result = run("embed", copy, "--sidecar-only")
    assert result.exit_code == 0, result.output
    sidecar = tag_dir / "ckptspec.json"
    pt_files = len([n for n in before if n.endswith(".pt")])
    assert result.stdout == f"{sidecar}: written (checkpoint index, {pt_files} files)\n" and result.stderr == ""
    assert sidecar.read_bytes() == (tmp_path / "generated.json").read_bytes()
    assert contents(tag_dir) == {**before, "ckptspec.json": sidecar.read_bytes()} and hidden(copy) == []

    assert run("validate", copy).exit_code == 0
    assert run("validate", sidecar, "--checkpoint", copy).exit_code == 0
    listed = run("extract", copy, "--list")
    domains = len(json.loads(sidecar.read_text())["domains"])
    assert listed.exit_code == 0 and listed.stdout.splitlines() == [
        f"{sidecar}: sidecar, checkpoint index 1.0.0, {domains} domains",
        f"{copy}: 1 copy",
    ], listed.stdout
    again = run("embed", copy, "--sidecar-only")  # its own record: the files match it, the same bytes again
    assert (
        again.exit_code == 0
        and again.stdout == result.stdout
        and contents(tag_dir)["ckptspec.json"] == (tmp_path / "generated.json").read_bytes()
    )


@pytest.mark.parametrize("name", KINDS.values(), ids=KINDS.keys())
def test_a_flipped_bit_after_the_record_is_refused_until_rehash(ds, name, tmp_path):
    copy, tag_dir = copy_of(ds, name, tmp_path)
    assert run("embed", copy, "--sidecar-only").exit_code == 0
    shard = sorted(p for p in tag_dir.glob("*.pt"))[-1]
    flip_a_bit(shard)
    before = contents(tag_dir)

    result = run("embed", copy, "--sidecar-only")
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert f"{shard.name}: " in result.stderr and " CK209 " in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"{copy}: not embedded: the files do not match what ckptspec.json records; nothing was written "
        + REHASH_HINT.format(copy)
    )
    assert contents(tag_dir) == before and hidden(copy) == [], "a refused embed wrote something"
    caught = run("validate", copy, "--format", "json")  # the sidecar's hash still catches it: validate reads it
    assert caught.exit_code == 1
    assert ("CK209", shard.name) in {(f["code"], f.get("file")) for f in json.loads(caught.stdout)["findings"]}

    rehashed = run("embed", copy, "--sidecar-only", "--rehash")
    assert rehashed.exit_code == 0, rehashed.output
    assert "re-recorded from the files as they are now (CK209" in rehashed.stdout
    after = run("validate", copy, "--format", "json")
    codes = {f["code"] for f in json.loads(after.stdout)["findings"]}
    # The record now holds the file as it is (what the user asked for); stage 0's masters still show the flipped bf16
    # weight, which is not its fp32 master rounded: caught without any record (CK235).
    assert codes == ({"CK235"} if name == KINDS["stage0"] else set()), codes


def test_encodings_and_no_hash_are_the_plain_embeds(ds, tmp_path):
    """msgpack without hashes: generate's index in msgpack; a JSON sidecar written after it replaces it."""
    copy, tag_dir = copy_of(ds, KINDS["tp2xpp2"], tmp_path)
    assert run("generate", copy, "-o", tmp_path / "plain.json").exit_code == 0
    result = run("embed", copy, "--sidecar-only", "--no-hash", "--encoding", "msgpack")
    assert result.exit_code == 0, result.output
    generated = json.loads((tmp_path / "plain.json").read_text())
    assert (tag_dir / "ckptspec.msgpack").read_bytes() == dumps(generated, "msgpack")
    assert run("validate", copy).exit_code == 0
    assert run("embed", copy, "--sidecar-only").exit_code == 0
    assert sorted(p.name for p in tag_dir.glob("ckptspec.*")) == ["ckptspec.json"]


def test_a_document_given_must_describe_this_checkpoint(ds, tmp_path):
    """CK304 by name: a format 1.x manifest, an index of another layout; nothing written. Its own index is taken,
    and what it records is checked against the files as the sidecar is."""
    copy, tag_dir = copy_of(ds, KINDS["pipeline-pp2"], tmp_path)
    manifest, other, own = tmp_path / "manifest.json", tmp_path / "other.json", tmp_path / "own.json"
    assert run("generate", COMMITTED["s2-bf16-ws2"], "-o", manifest).exit_code == 0
    assert run("generate", ds.path(KINDS["autotp-tp2"]), "-o", other).exit_code == 0
    assert run("generate", copy, "--hash", "-o", own).exit_code == 0
    before = contents(tag_dir)

    result = run("embed", copy, "--sidecar-only", "--manifest", manifest)
    assert result.exit_code == 1 and result.stderr.startswith(
        f"{tag_dir}: CK304 the manifest given is a format 1.x manifest, but this is a tensor/pipeline-parallel "
        "checkpoint (a checkpoint index) "
    ), result.stderr
    result = run("embed", copy, "--sidecar-only", "--manifest", other)
    assert result.exit_code == 1 and result.stderr.startswith(
        f"{tag_dir}: CK304 the manifest does not describe this checkpoint: at $."
    ), result.stderr
    assert contents(tag_dir) == before and hidden(copy) == []

    layer = sorted(tag_dir.glob("layer_*.pt"))[0]
    flip_a_bit(layer)
    result = run("embed", copy, "--sidecar-only", "--manifest", own)  # the record given: the flipped bit is caught
    assert result.exit_code == 1 and result.stderr.startswith(f"{layer.name}: $.layer_files[0]: CK230 "), result.stderr
    assert "the files do not match what the manifest given records; nothing was written" in result.stderr
    assert contents(tag_dir) == {**before, **{n: b for n, b in contents(tag_dir).items() if n.startswith("layer_")}}
    assert not (tag_dir / "ckptspec.json").exists()
    restored = tmp_path / "restored"
    shutil.copytree(ds.path(KINDS["pipeline-pp2"]), restored)
    assert run("embed", restored, "--sidecar-only", "--manifest", own).exit_code == 0
    assert (restored / tag_dir.name / "ckptspec.json").read_bytes() == own.read_bytes()


def test_stopped_anywhere_the_tag_has_no_sidecar_or_the_whole_one(ds, tmp_path, crash):
    """SIGKILL at every sampled step of the local write: readers see no sidecar (the index is generated) or the
    complete one; the next embed finishes the job with the same bytes."""
    copy, tag_dir = copy_of(ds, KINDS["moe-ep2"], tmp_path)
    pristine = tmp_path / "pristine"
    shutil.copytree(copy, pristine)
    command = ["embed", str(copy), "--sidecar-only"]
    steps = crash.steps(command, tmp_path / "count")
    complete = contents(tag_dir)
    assert steps >= 3, steps  # the temporary's write, its rename, the other encoding's removal
    seen = set()
    for step in points(steps):
        shutil.rmtree(copy)
        shutil.copytree(pristine, copy)
        killed = crash.run(command, f"kill:{step}")
        assert killed.returncode == -9, (step, killed.stderr)
        sidecar = tag_dir / "ckptspec.json"
        whole = sidecar.exists() and sidecar.read_bytes() == complete["ckptspec.json"]
        seen.add("none" if not sidecar.exists() else "whole" if whole else "part")
        assert run("validate", copy).exit_code == 0, step
        assert run(*command).exit_code == 0, step
        assert contents(tag_dir) == complete and hidden(copy) == [], step
    assert "part" not in seen and "none" in seen, seen


def test_a_universal_folder_gets_its_index(ds, tmp_path):
    """ds_to_universal's folder (``--tag``): the index ``generate --tag --hash`` writes, read back by validate."""
    copy, _ = copy_of(ds, KINDS["autotp-tp2"], tmp_path)
    tag = (copy / "latest_universal").read_text().strip()
    assert run("generate", copy, "--tag", tag, "--hash", "-o", tmp_path / "generated.json").exit_code == 0
    result = run("embed", copy, "--tag", tag, "--sidecar-only")
    assert result.exit_code == 0 and ": written (checkpoint index, " in result.stdout, result.output
    assert (copy / tag / "ckptspec.json").read_bytes() == (tmp_path / "generated.json").read_bytes()
    assert run("validate", copy, "--tag", tag).exit_code == 0
    assert run("validate", copy / tag / "ckptspec.json", "--checkpoint", copy, "--tag", tag).exit_code == 0


@pytest.mark.parametrize(
    "name", [hook_name(n) for n in ("pp2-s1-fp32-ws2", "tp2-s1-fp32-ws2", "moe-ep2-s0-bf16-ws2", "tp2pp2-s1-bf16-ws4")]
)
def test_the_save_hooks_index_is_a_record_and_describes_the_layout(ds, name, tmp_path):
    """Saved through ckptspec.deepspeed.save_checkpoint: the hook's sidecar (what only the live engine knows: ranks,
    members, degrees and placement sources, the optimizer's class) is checked as a record and, given as M, agrees
    with the layout generated from the files; the sidecar written is generate's index."""
    copy, tag_dir = copy_of(ds, name, tmp_path, sidecar=True)
    hooked = tmp_path / "hooked.json"
    shutil.copy(tag_dir / "ckptspec.json", hooked)
    assert json.loads(hooked.read_text())["topology"]["degrees_source"] == "engine"
    assert run("generate", copy, "--hash", "-o", tmp_path / "generated.json").exit_code == 0
    for args in ([], ["--manifest", hooked]):
        result = run("embed", copy, "--sidecar-only", *args)
        assert result.exit_code == 0, result.output
        assert (tag_dir / "ckptspec.json").read_bytes() == (tmp_path / "generated.json").read_bytes()
        assert run("validate", copy).exit_code == 0


# (kind, a file its hash check covers, the code when that file changed)
NEWER = {
    "layer": (KINDS["pipeline-pp2"], "layer_00-model_states.pt", "CK230"),
    "expert": (KINDS["moe-ep2"], "layer_0_expert_0_mp_rank_00_model_states.pt", "CK241"),
    "masters": (KINDS["stage0"], "mp_rank_00_model_states.pt", "CK209"),
}


@pytest.mark.parametrize(("name", "shard", "code"), NEWER.values(), ids=NEWER.keys())
def test_the_hashes_of_an_index_of_a_newer_minor_are_checked_as_any(ds, name, shard, code, tmp_path):
    """A sidecar of a newer 1.x minor (read by the models' tolerant twins, CK004): the hashes of its layer, expert and
    masters files match the files (a twin's hash never equalled a computed one: every such file was "changed"), and a
    flipped bit is still caught by the hash."""
    copy, tag_dir = copy_of(ds, name, tmp_path)
    assert run("embed", copy, "--sidecar-only").exit_code == 0
    sidecar = tag_dir / "ckptspec.json"
    newer = {**json.loads(sidecar.read_text()), "format_version": "1.9.0", "a_later_field": 1}
    sidecar.write_text(json.dumps(newer))
    result = run("validate", copy, "--format", "json")
    assert result.exit_code == 0 and [f["code"] for f in json.loads(result.stdout)["findings"]] == ["CK004"]
    flip_a_bit(tag_dir / shard)
    caught = run("validate", copy, "--format", "json")
    assert caught.exit_code == 1
    assert (code, shard) in {(f["code"], f.get("file")) for f in json.loads(caught.stdout)["findings"]}, caught.stdout
