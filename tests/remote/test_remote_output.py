"""Outputs written to moto's S3 server (issue #43, item 4): ``reconstruct`` and ``reshard`` to an ``s3://`` URL.

The endpoint and credentials come from the environment a user sets (``s3_env``). Each test compares what
readers of the URL see with the same command's local output, byte for byte:

* complete runs: every object equals the local file of the same name, and nothing else is there;
* SIGKILL at sampled steps of a run (``tests/_harness/crash.py``; the upload's steps are ``_fs.io_point``'s
  ``write`` per part, ``rename`` at each object's completion, ``remove``): a reader (the object that makes the
  output visible, and what it names) sees the previous complete output or none, never a mix; the command run
  again then leaves the new output;
* a store that goes away mid-upload: exit 2 with the code of the failure naming the object's URL, no traceback.

``embed URL --sidecar-only`` writes one object into a checkpoint already at the URL: the local embed's sidecar, byte
for byte, after the files were checked against what is recorded; stopped anywhere, the previous sidecar or the new one.
Of a checkpoint a checkpoint index describes (tensor x pipeline, MoE, stage 0, pipeline): its index, the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from _harness.faults import flip_a_byte
from _harness.scenarios import dcp_save_name
from _harness.states import points, visible
from click.testing import CliRunner

from ckptspec import _fs
from ckptspec.cli import cli
from ckptspec.location import upload

CHECKPOINT = "s2-bf16-ws2"
PREVIOUS = ["--max-shard-size", "2KB"]  # 6 fp32 shards and their index
OVERWRITES = ["--max-shard-size", "1KB", "--dtype", "bf16"]  # 6 bf16 shards: the same names, other bytes
BESIDE = ["--max-shard-size", "4KB"]  # 3 shards: other names than the previous output's


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


_buckets = iter(range(10**6))


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path, monkeypatch) -> Path:
    """The commands' TMPDIR, the upload's staging there, is the test's own: a killed upload's staging another
    process left in a shared one would be swept first, steps that moved every kill point (one run was not killed)."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    return tmpdir


@pytest.fixture
def url(s3, s3_env) -> str:
    """A new, empty output URL in a bucket of this server."""
    fs = s3.filesystem()
    if not fs.exists("out"):
        import boto3

        boto3.client("s3", endpoint_url=s3.endpoint, **s3.credentials).create_bucket(Bucket="out")
    return f"s3://out/run{os.getpid()}-{next(_buckets)}"


def stored(s3, url: str) -> dict[str, bytes]:
    """Every object below ``url``, by name relative to it."""
    fs = s3.filesystem()
    base = url.removeprefix("s3://")
    return {name[len(base) + 1 :]: fs.cat_file(name) for name in fs.find(base)}


def seen(s3, url: str) -> dict[str, bytes]:
    """What a reader of a reconstruction sees: the index and the shards it names, or the single file; {}: none."""
    objects = stored(s3, url)
    if "model.safetensors.index.json" in objects:
        index = objects["model.safetensors.index.json"]
        names = sorted(set(json.loads(index)["weight_map"].values()))
        missing = [n for n in names if n not in objects]
        assert not missing, f"the index names shards that are not there: {missing}"
        return {"model.safetensors.index.json": index, **{n: objects[n] for n in names}}
    if "model.safetensors" in objects:
        return {"model.safetensors": objects["model.safetensors"]}
    return {}


def local_output(ds, tmp_path: Path, name: str, *args) -> dict[str, bytes]:
    out = tmp_path / name
    assert run("reconstruct", ds.path(CHECKPOINT), out, "-q", *args).exit_code == 0
    return visible(out)


@pytest.mark.parametrize("args", [[], PREVIOUS], ids=["single-file", "sharded"])
def test_reconstruct_to_s3_is_the_local_output(ds, s3, url, tmp_path, args):
    local = local_output(ds, tmp_path, "local", *args)
    result = run("reconstruct", ds.path(CHECKPOINT), url, *args)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{url}: wrote ")
    assert stored(s3, url) == local  # the same names, the same bytes, nothing else


@pytest.mark.parametrize("args", [OVERWRITES, BESIDE, []], ids=["same-names", "other-names", "single-file"])
def test_reconstruct_over_a_previous_output_on_s3(ds, s3, url, tmp_path, args):
    assert run("reconstruct", ds.path(CHECKPOINT), url, "-q", *PREVIOUS).exit_code == 0
    result = run("reconstruct", ds.path(CHECKPOINT), url, "-q", *args)
    assert result.exit_code == 0, result.output
    assert stored(s3, url) == local_output(ds, tmp_path, "new", *args)  # the previous output's objects are gone


def test_reshard_to_s3_is_the_local_output(ds, s3, url, tmp_path):
    local = tmp_path / "local"
    assert run("reshard", ds.path(CHECKPOINT), local, "--world-size", "1").exit_code == 0
    result = run("reshard", ds.path(CHECKPOINT), url, "--world-size", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{url}: global_step2 resharded from 2 to 1 ranks")
    assert stored(s3, url) == visible(local)
    assert run("validate", url).exit_code == 0  # hashes included: the uploaded checkpoint reads as valid
    again = run("reshard", ds.path(CHECKPOINT), url, "--world-size", "1")
    assert again.exit_code == 2 and f"{url}: CK909 " in again.stderr  # as a local OUTPUT that is not empty


def test_a_dcp_checkpoint_reconstructed_and_resharded_to_s3_is_the_local_output(ds, s3, url, tmp_path):
    """A torch DCP source (an FSDP2 save) goes through the same staging and upload: its weights and optimizer
    state, and its DeepSpeed ZeRO-2 conversion, equal the local outputs object for object."""
    source = ds.path(dcp_save_name(2)) / "dcp"
    for command, args in (("reconstruct", ["--optimizer-state"]), ("reshard", ["--world-size", "2", "--stage", "2"])):
        local, remote = tmp_path / command, f"{url}/{command}"
        assert run(command, source, local, *args).exit_code == 0
        result = run(command, source, remote, *args)
        assert result.exit_code == 0, result.output
        assert stored(s3, remote) == visible(local), command
    assert run("validate", f"{url}/reshard").exit_code == 0


def test_parts_are_verified_by_etag_and_memory_is_a_few_parts(s3, url, tmp_path, monkeypatch):
    """A file of several parts (the least part S3 takes: 5 MiB): the object is the file, checked against the
    ETag moto computes over the parts it stored; with an ETag that is not the parts' MD5 it is read back."""
    monkeypatch.setenv("CKPTSPEC_REMOTE_PART", str(upload.MIN_PART))
    out = tmp_path / "out"
    out.mkdir()
    data = os.urandom(2 * upload.MIN_PART + 12345)
    (out / "big.bin").write_bytes(data)
    (out / "latest").write_text("tag")
    done = upload.publish(out, url, ["latest"])
    assert [(u.name, u.size, u.verified_by) for u in done] == [("big.bin", len(data), "etag"), ("latest", 3, "etag")]
    assert stored(s3, url) == {"big.bin": data, "latest": b"tag"}

    monkeypatch.setattr(upload, "_etag_of", lambda md5s: ("0" * 32,))  # as SSE-KMS's ETags: not the bytes' MD5
    again = upload.publish(out, url, ["latest"])
    assert [u.verified_by for u in again] == ["re-read", "re-read"]


def upload_points(crash, command: list, local_command: list, tmp: Path) -> list[int]:
    """Sampled steps of the upload: those after the steps the same command takes to write a local directory
    (the staging), every one with ``CKPTSPEC_CRASH_ALL=1``."""
    total = crash.steps(command, tmp / "remote")
    local = crash.steps(local_command, tmp / "local")
    assert total > local
    return [local + step for step in points(total - local, sample=5)]


def put(s3, url: str, files: dict[str, bytes]) -> None:
    """``url`` holding exactly ``files`` (the previous output, put back as any uploader would)."""
    fs = s3.filesystem()
    base = url.removeprefix("s3://")
    for name in fs.find(base):
        fs.rm_file(name)
    for name, data in files.items():
        fs.pipe_file(f"{base}/{name}", data)


@pytest.mark.parametrize("args", [OVERWRITES, BESIDE], ids=["same-names", "other-names"])
def test_reconstruct_killed_during_upload_leaves_previous_or_none(ds, s3, url, tmp_path, crash, args):
    source = ds.path(CHECKPOINT)
    previous = local_output(ds, tmp_path, "previous", *PREVIOUS)
    new = local_output(ds, tmp_path, "new", *args)
    command = ["reconstruct", source, url, "-q", *args]
    put(s3, url, previous)
    sampled = upload_points(crash, command, ["reconstruct", source, tmp_path / "counted", "-q", *args], tmp_path)
    states = set()
    for step in sampled:
        put(s3, url, previous)
        killed = crash.run(command, f"kill:{step}")
        assert killed.returncode == -9, (step, killed.stderr)
        after = seen(s3, url)
        assert after in (previous, new, {}), step  # never a mix (the old index over new shards)
        states.add("previous" if after == previous else "new" if after == new else "none")
        done = crash.run(command)
        assert done.returncode == 0, (step, done.stderr)
        assert stored(s3, url) == new, step  # and the previous output's objects the new one has not are gone
    # the kills fell in the upload: readers saw no output while same-named shards were rewritten; beside them, the
    # previous output until the new index landed, the new one while the previous one's shards were removed
    assert ({"none"} if args is OVERWRITES else {"previous", "new"}) <= states, states
    assert not [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(".ckptspec-upload.*") if _fs.is_stale(p)]


def test_reshard_killed_during_upload_leaves_no_output(ds, s3, url, tmp_path, crash):
    """A new URL: killed anywhere in the upload, readers see no ``latest`` (nothing to load) or the whole output."""
    local = tmp_path / "local"
    assert run("reshard", ds.path(CHECKPOINT), local, "--world-size", "1").exit_code == 0
    complete = visible(local)

    def command(output) -> list:
        return ["reshard", ds.path(CHECKPOINT), output, "--world-size", "1"]

    sampled = upload_points(crash, command(url + "-count"), command(tmp_path / "counted"), tmp_path)
    for step in sampled:
        target = f"{url}-{step}"
        killed = crash.run(command(target), f"kill:{step}")
        assert killed.returncode == -9, (step, killed.stderr)
        objects = stored(s3, target)
        assert "latest" not in objects or objects == complete, step
        if "latest" not in objects:
            assert run("validate", target, "--no-hash").exit_code != 0, step  # nothing a reader takes as a checkpoint


def test_store_gone_mid_upload_is_an_error_naming_the_url(ds, s3_factory, tmp_path, monkeypatch):
    server = s3_factory()
    for key, value in {**server.env, "CKPTSPEC_REMOTE_TIMEOUT": "1", "CKPTSPEC_REMOTE_RETRIES": "0"}.items():
        monkeypatch.setenv(key, value)
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, **server.credentials).create_bucket(Bucket="out")
    real = upload._upload
    calls = []

    def upload_then_stop(store, source, path, name):
        calls.append(name)
        if len(calls) == 2:
            server.stop()  # the store goes away after the first object
        return real(store, source, path, name)

    monkeypatch.setattr(upload, "_upload", upload_then_stop)
    url = "s3://out/gone"
    result = run("reconstruct", ds.path(CHECKPOINT), url, *PREVIOUS)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{url}/model-00002-of-00006.safetensors: CK915 upload failed: "), line
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f".ckptspec-upload.ckptspec-*-{os.getpid()}-*"))


def test_export_universal_to_s3_is_the_local_output(ds, s3, url, tmp_path):
    local = tmp_path / "local"
    assert run("export-universal", ds.path(CHECKPOINT), local).exit_code == 0
    result = run("export-universal", ds.path(CHECKPOINT), url)
    assert result.exit_code == 0, result.output
    assert stored(s3, url) == visible(local)


def test_export_to_s3_is_the_local_output(ds, s3, url, tmp_path):
    """Every object; DCP's ``.metadata`` records the directory torch wrote into (it differs between two local runs
    too): the rest of it, the entries and where their bytes are, is the same."""
    local = tmp_path / "local"
    assert run("export", ds.path(CHECKPOINT), local, "-q").exit_code == 0
    result = run("export", ds.path(CHECKPOINT), url, "-q")
    assert result.exit_code == 0, result.output
    objects, files = stored(s3, url), visible(local) | {".metadata": (local / ".metadata").read_bytes()}
    assert sorted(objects) == sorted(files)
    metadata = (objects.pop(".metadata"), files.pop(".metadata"))
    assert objects == files
    remote, written = (pickle.loads(m) for m in metadata)  # torch's own pickle of what this test's export wrote
    assert remote.state_dict_metadata == written.state_dict_metadata
    assert remote.storage_data == written.storage_data


def test_manifest_writers_to_s3(ds, s3, url, tmp_path):
    """``generate -o``, ``convert``: one object, the local file's bytes."""
    local, remote = tmp_path / "m.json", f"{url}/m.json"
    assert run("generate", ds.path(CHECKPOINT), "-o", local).exit_code == 0
    assert run("generate", ds.path(CHECKPOINT), "-o", remote).exit_code == 0
    assert run("convert", local, tmp_path / "m.msgpack").exit_code == 0
    assert run("convert", remote, f"{url}/m.msgpack").exit_code == 0  # read from the URL, written to one
    assert stored(s3, url) == {"m.json": local.read_bytes(), "m.msgpack": (tmp_path / "m.msgpack").read_bytes()}
    assert run("validate", remote, "--checkpoint", ds.path(CHECKPOINT)).exit_code == 0


def test_reconstruct_to_the_same_url_twice_in_one_process(ds, s3, url, tmp_path):
    """The Python API in a long-running process: what it saw of the URL before its own upload is not taken for what
    is there after it (the second run finds the first's shards and removes them)."""
    import ckptspec

    ckptspec.reconstruct(ds.path(CHECKPOINT), url, max_shard_size=2000)
    ckptspec.reconstruct(ds.path(CHECKPOINT), url, max_shard_size=4000)
    assert stored(s3, url) == local_output(ds, tmp_path, "new", "--max-shard-size", "4000")
    ckptspec.reconstruct(ds.path(CHECKPOINT), url)
    assert stored(s3, url) == local_output(ds, tmp_path, "single")


def test_sigterm_during_upload_says_what_readers_see(ds, s3, url, tmp_path, crash):
    """Stopped at the last step of the upload, the line says what readers see, not "nothing was written": over shards
    of the same names, no output (the earlier index was removed first); beside them, the new output (the last step
    removes one of the earlier output's shards)."""
    source = ds.path(CHECKPOINT)
    previous = local_output(ds, tmp_path, "previous", *PREVIOUS)
    for args, says, readers in (
        (OVERWRITES, f"terminated; {url} holds no output: ", {}),
        (BESIDE, f"terminated; {url} holds the complete new output ", local_output(ds, tmp_path, "beside", *BESIDE)),
    ):
        put(s3, url, previous)
        command = ["reconstruct", source, url, "-q", *args]
        last = crash.steps(command, tmp_path / "count")
        put(s3, url, previous)
        stopped = crash.run(command, f"term:{last}")
        assert stopped.returncode == 143 and says in stopped.stderr, stopped.stderr
        assert seen(s3, url) == readers


# --------------------------------------------------------------------------- embed URL --sidecar-only

TAG = "global_step2"
OPT1 = f"{TAG}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture
def at_url(ds, s3, s3_env) -> str:
    """A new copy of the real ZeRO-2 checkpoint (no sidecar) at an s3:// URL."""
    local = ds.path(CHECKPOINT)
    assert (local / "latest").read_text().strip() == TAG and not list(local.glob("*/ckptspec.*"))
    return s3.upload(local)


@pytest.mark.parametrize(
    ("checkpoint", "options"),
    [(CHECKPOINT, []), (CHECKPOINT, ["--no-hash", "--encoding", "msgpack"]), ("embed-s2-bf16-ws3-rr-exclude", [])],
    ids=["hashed-json", "msgpack", "saved-with-ckptspec"],
)
def test_embed_sidecar_at_s3_is_the_local_sidecar(ds, s3, s3_env, tmp_path, checkpoint, options):
    """One object written, the bytes the local ``embed --sidecar-only`` writes; every other object untouched; the
    checkpoint at the URL then reads as valid against it. Saved with ckptspec (a sidecar there already, the layout in
    the model states, frozen parameters excluded: names only that layout knows): the same, the sidecar rewritten."""
    local = ds.path(checkpoint)
    url, copy = s3.upload(local), tmp_path / "local"
    shutil.copytree(local, copy)
    here = run("embed", copy, "--sidecar-only", *options)
    assert here.exit_code == 0, here.output
    name = "ckptspec.msgpack" if "msgpack" in options else "ckptspec.json"
    before = stored(s3, url)
    result = run("embed", url, "--sidecar-only", *options)
    assert result.exit_code == 0, result.output
    tag = (local / "latest").read_text().strip()
    assert result.stdout == here.stdout.replace(str(copy), url) and result.stdout.startswith(f"{url}/{tag}/{name}: ")
    assert stored(s3, url) == {**before, f"{tag}/{name}": (copy / tag / name).read_bytes()}
    assert run("validate", url).exit_code == 0
    assert run("validate", f"{url}/{tag}/{name}", "--checkpoint", url).exit_code == 0
    assert run("extract", url, "--list").stdout.startswith(f"{url}/{tag}/{name}: sidecar, format 1.1.0, ")


def test_embed_at_s3_refuses_files_that_disagree_with_the_sidecar_unless_rehash(at_url, s3):
    """As the local embed: files that no longer match the sidecar are not re-recorded (exit 1, nothing written),
    and ``validate`` still catches them; ``--rehash`` records them as they are."""
    url = at_url
    assert run("embed", url, "--sidecar-only").exit_code == 0
    fs, key = s3.filesystem(), f"{url.removeprefix('s3://')}/{OPT1}"
    damaged = flip_a_byte(fs.cat_file(key))
    fs.pipe_file(key, damaged)
    before = stored(s3, url)

    result = run("embed", url, "--sidecar-only")
    assert result.exit_code == 1, result.output
    assert ": CK209 " in result.stderr and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        f"{url}: not embedded: the files do not match what ckptspec.json records; nothing was written "
        "(hint: restore the files the record describes; if they changed on purpose, record them as they "
        f"are now with `ckptspec embed {url} --rehash`)"
    )
    assert stored(s3, url) == before
    caught = run("validate", url)  # the sidecar's hash still catches the damage
    assert caught.exit_code == 1 and f"{OPT1.split('/')[1]}: $.files[2].hash (rank 1): CK209 " in caught.stdout

    result = run("embed", url, "--sidecar-only", "--rehash")
    assert result.exit_code == 0, result.output
    assert "re-recorded from the files as they are now (CK209" in result.stdout
    sidecar = json.loads(stored(s3, url)[f"{TAG}/ckptspec.json"])
    recorded = next(f for f in sidecar["files"] if f"{TAG}/{f['path']}" == OPT1)["hash"]["digest"]
    assert recorded == hashlib.sha256(damaged).hexdigest()
    assert run("validate", url).exit_code == 0  # what the user asked for, explicitly


def test_embed_at_a_url_without_sidecar_only_is_refused_by_name(at_url, s3):
    url = at_url
    before = stored(s3, url)
    result = run("embed", url)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"{url}: CK916 embed cannot rewrite the model-states objects at a URL")
    assert f"`ckptspec embed {url} --sidecar-only`" in result.stderr
    assert stored(s3, url) == before
    http = run("embed", "https://example.invalid/ckpt", "--sidecar-only")  # HTTP: read-only, before any request
    assert http.exit_code == 2 and "CK916" in http.stderr and "read-only" in http.stderr, http.output


def test_embed_killed_during_the_upload_leaves_the_previous_sidecar_or_the_new_one(at_url, s3, tmp_path, crash):
    """SIGKILL at every step of the upload (the sidecar's part, its completion, the removal of the previous one of
    the other encoding): readers find the previous sidecar or the new one, whole, and the checkpoint valid."""
    url = at_url
    assert run("embed", url, "--sidecar-only", "--no-hash", "--encoding", "msgpack").exit_code == 0
    previous = stored(s3, url)
    command = ["embed", url, "--sidecar-only"]
    steps = crash.steps(command, tmp_path / "count")
    new = stored(s3, url)
    assert sorted(set(new) ^ set(previous)) == [f"{TAG}/ckptspec.json", f"{TAG}/ckptspec.msgpack"]
    assert steps == 3
    states = set()
    for step in points(steps):
        put(s3, url, previous)
        killed = crash.run(command, f"kill:{step}")
        assert killed.returncode == -9, (step, killed.stderr)
        objects = stored(s3, url)
        sidecars = [f"{TAG}/{name}" for name in ("ckptspec.json", "ckptspec.msgpack") if f"{TAG}/{name}" in objects]
        read = objects[sidecars[0]] if sidecars else None  # what readers take: ckptspec.json first
        states.add("previous" if objects == previous else "new" if read == new[f"{TAG}/ckptspec.json"] else "other")
        assert run("validate", url).exit_code == 0, step
        assert run(*command).exit_code == 0, step
        assert stored(s3, url) == new, step
    assert states == {"previous", "new"}, states
    put(s3, url, previous)
    stopped = crash.run(command, f"term:{steps}")  # SIGTERM while removing the previous one: says what is there
    assert stopped.returncode == 143, stopped.stderr
    assert f"terminated; {url}/{TAG}/ckptspec.json was written; the earlier sidecar " in stopped.stderr, stopped.stderr


def test_embed_at_s3_store_gone_mid_upload_is_an_error_naming_the_sidecar(ds, s3_factory, monkeypatch):
    server = s3_factory()
    for key, value in {**server.env, "CKPTSPEC_REMOTE_TIMEOUT": "1", "CKPTSPEC_REMOTE_RETRIES": "0"}.items():
        monkeypatch.setenv(key, value)
    url = server.upload(ds.path(CHECKPOINT))
    real = upload._upload

    def stop_then_upload(store, source, path, name):
        server.stop()  # the store goes away once everything was read and checked
        return real(store, source, path, name)

    monkeypatch.setattr(upload, "_upload", stop_then_upload)
    result = run("embed", url, "--sidecar-only")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{url}/{TAG}/ckptspec.json: CK915 upload failed: "), line


# --------------------------------------------------------------------------- embed URL --sidecar-only: index kinds


@pytest.mark.parametrize("name", ["tp2pp2-s1-fp32-ws4", "moe-ep2-s1-fp32-ws2", "s0-bf16-ws2"])
def test_embed_index_sidecar_at_s3_is_the_local_sidecar(ds, s3, s3_env, tmp_path, name):
    """A checkpoint a checkpoint index describes (tensor x pipeline, MoE, stage 0): one object written, the bytes the
    local ``embed --sidecar-only`` writes (generate's index); ``validate``, ``validate SIDECAR --checkpoint`` and
    ``extract --list`` of the URL read it."""
    local = ds.path(name)
    url, copy = s3.upload(local), tmp_path / "local"
    shutil.copytree(local, copy)
    here = run("embed", copy, "--sidecar-only")
    assert here.exit_code == 0, here.output
    before = stored(s3, url)
    result = run("embed", url, "--sidecar-only")
    assert result.exit_code == 0, result.output
    tag = (local / "latest").read_text().strip()
    assert result.stdout == here.stdout.replace(str(copy), url) and ": written (checkpoint index, " in result.stdout
    assert stored(s3, url) == {**before, f"{tag}/ckptspec.json": (copy / tag / "ckptspec.json").read_bytes()}
    assert run("validate", url).exit_code == 0
    assert run("validate", f"{url}/{tag}/ckptspec.json", "--checkpoint", url).exit_code == 0
    assert run("extract", url, "--list").stdout.startswith(f"{url}/{tag}/ckptspec.json: sidecar, checkpoint index ")
    refused = run("embed", url)  # the model-states objects: CK916 before anything is read, naming --sidecar-only
    assert refused.exit_code == 2 and f"`ckptspec embed {url} --sidecar-only`" in refused.stderr


def test_embed_index_at_s3_refuses_a_flipped_bit_unless_rehash(ds, s3, s3_env):
    """The index recorded at the URL catches a bit flipped in a file there afterwards (an optimizer file of the second
    stage, which no other file repeats): nothing written, exit 1; ``--rehash`` records the files as they are."""
    local = ds.path("pp2-s1-fp32-ws2")
    url, tag = s3.upload(local), (local / "latest").read_text().strip()
    assert run("embed", url, "--sidecar-only").exit_code == 0
    optim = "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    fs, key = s3.filesystem(), f"{url.removeprefix('s3://')}/{tag}/{optim}"
    fs.pipe_file(key, flip_a_byte(fs.cat_file(key)))
    before = stored(s3, url)

    result = run("embed", url, "--sidecar-only")
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.startswith(f"{optim}: $.domains[1].manifest.files[1].hash (rank 0): CK209 "), result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"{url}: not embedded: the files do not match what ckptspec.json records; nothing was written "
    )
    assert stored(s3, url) == before
    assert run("validate", url).exit_code == 1  # the sidecar's hash still catches it

    rehashed = run("embed", url, "--sidecar-only", "--rehash")
    assert rehashed.exit_code == 0 and "re-recorded from the files as they are now (CK209" in rehashed.stdout
    assert run("validate", url).exit_code == 0
