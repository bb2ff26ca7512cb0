"""examples/node-reader (plain Node.js) rebuilds what `ckptspec reconstruct --untie` rebuilds, bit for bit.

For every real DeepSpeed checkpoint of the matrix (tests/_harness/scenarios.py): `ckptspec generate
--hash` (a format 1.1 manifest), then `node examples/node-reader/reader.js MANIFEST CHECKPOINT
OUT.safetensors` (the command line of examples/node-reader/README.md and docs/loaders.md), then
`ckptspec reconstruct --untie`; every key (trainable, frozen, buffers, tied aliases) must match in
name, shape, dtype and bytes. The node reader parses no pickle and no zip directory: 1.1's locators
give it every tensor, and it checks each one's digest. Given a 1.0 manifest it writes the
trainable parameters and their ties only, and names the rest in its `ckptspec.absent` metadata.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import MATRIX
from click.testing import CliRunner
from safetensors import safe_open

from ckptspec.cli import cli
from ckptspec.format.migrate import migrate_document

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node-reader"
READER = NODE_DIR / "reader.js"

# Every matrix point: stage 1/2/3; bf16, fp16, fp32; world size 1-4; tied, frozen and buffers
# everywhere; two groups, round robin, sub-groups, tail padding saved (BF16_Optimizer),
# parameter-alignment padding, excluded frozen params, zero-element params.
POINTS = MATRIX


def node(*args: str | Path, timeout: int = 120) -> subprocess.CompletedProcess:
    assert (NODE_DIR / "node_modules" / "ajv").is_dir(), "run ./scripts/env.sh (npm ci in examples/node-reader)"
    return subprocess.run(["node", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def ckptspec(*args: str | Path) -> None:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def checkpoints(ds) -> dict[str, Path]:
    return {name: ds.path(name) for name in POINTS}


@pytest.mark.parametrize("point", POINTS)
def test_node_reader_matches_ckptspec_reconstruct(point, checkpoints, tmp_path):
    save_dir = checkpoints[point]
    manifest = tmp_path / "manifest.json"
    ckptspec("generate", save_dir, "-o", manifest, "--hash")
    out = tmp_path / "node.safetensors"
    run = node(READER, manifest, save_dir, out)
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    ckptspec("reconstruct", "-q", "--untie", save_dir, tmp_path / "ref")

    doc = json.loads(manifest.read_text("utf-8"))
    assert doc["format_version"] == "1.1.0" and doc["aliases"] and doc["buffers"]  # every matrix point has both
    digested = [p for g in doc["groups"] for p in g["params"] if "digest" in p] + doc["frozen"] + doc["buffers"]
    assert digested and all("digest" in t for t in digested)  # the reader checked a digest for every tensor
    mine, my_meta = load(out)
    ref, ref_meta = load(tmp_path / "ref" / "model.safetensors")
    everything = {p["name"] for g in doc["groups"] for p in g["params"]}
    everything |= {t["name"] for t in doc["frozen"] + doc["buffers"] + doc["aliases"]}
    assert set(mine) == set(ref) == everything, "every key: trainable, frozen, buffers, aliases"
    for name, tensor in mine.items():
        assert (tensor.dtype, tensor.shape) == (ref[name].dtype, ref[name].shape), name
        assert tensor.tobytes() == ref[name].tobytes(), f"{point}: {name} differs"
    assert json.loads(my_meta["ckptspec.aliases"]) == json.loads(ref_meta["ckptspec.aliases"]) != {}
    excluded = {e["name"] for e in doc["excluded"]}
    assert set(json.loads(my_meta["ckptspec.absent"])) == excluded
    assert (
        run.stdout.splitlines()[0]
        == f"{out}: {len(mine)} tensors ({len(doc['aliases'])} of them tied aliases, written as copies)"
    )


def test_a_1_0_manifest_gives_the_trainable_parameters_only(checkpoints, tmp_path):
    """Format 1.0 locates the master partitions only: frozen parameters and buffers are named absent."""
    save_dir = checkpoints["s2-bf16-ws2"]
    manifest = tmp_path / "manifest.json"
    ckptspec("generate", save_dir, "-o", manifest)
    doc = migrate_document(json.loads(manifest.read_text("utf-8")), "1.0").document
    manifest.write_text(json.dumps(doc), "utf-8")
    out = tmp_path / "node.safetensors"
    run = node(READER, manifest, save_dir, out)
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    mine, meta = load(out)
    trainable = {p["name"] for g in doc["groups"] for p in g["params"]}
    assert set(mine) == trainable | {a["name"] for a in doc["aliases"]}
    assert set(json.loads(meta["ckptspec.absent"])) == {t["name"] for t in doc["frozen"] + doc["buffers"]}


# --------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def hashed_manifest(checkpoints, tmp_path_factory) -> str:
    manifest = tmp_path_factory.mktemp("manifest") / "manifest.json"
    ckptspec("generate", checkpoints["s2-bf16-ws2"], "-o", manifest, "--hash")
    return manifest.read_text("utf-8")


@pytest.fixture
def damaged(checkpoints, hashed_manifest, tmp_path) -> tuple[Path, Path, dict]:
    """A private copy of a stage-2 checkpoint's tag directory and its hashed manifest, to break."""
    tag = tmp_path / "ckpt"
    shutil.copytree(checkpoints["s2-bf16-ws2"] / "global_step2", tag)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(hashed_manifest, "utf-8")
    return tag, manifest, json.loads(hashed_manifest)


def optim_file(doc: dict) -> dict:
    return next(f for f in doc["files"] if f["partitions"] and f["ranks"] == [1])


def refused(run: subprocess.CompletedProcess, out: Path, status: int, line: str) -> None:
    """One line on stderr, no stack trace, nothing written."""
    assert (run.returncode, run.stdout, run.stderr) == (status, "", line + "\n")
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_truncated_shard(damaged, tmp_path):
    tag, manifest, doc = damaged
    shard = optim_file(doc)
    with open(tag / shard["path"], "r+b") as f:
        f.truncate(shard["size"] - 100)
    out = tmp_path / "out.safetensors"
    refused(
        node(READER, manifest, tag, out),
        out,
        1,
        f"{shard['path']}: CK208 is {shard['size'] - 100} bytes, the manifest says {shard['size']} "
        "(hint: the file was cut off or replaced; restore it)",
    )


def test_missing_shard(damaged, tmp_path):
    tag, manifest, doc = damaged
    (tag / optim_file(doc)["path"]).unlink()
    out = tmp_path / "out.safetensors"
    refused(
        node(READER, manifest, tag, out),
        out,
        1,
        f"{optim_file(doc)['path']}: CK206 is missing from the checkpoint directory "
        "(hint: restore the file from the run that wrote it)",
    )


def test_flipped_byte_fails_the_hash(damaged, tmp_path):
    tag, manifest, doc = damaged
    shard = optim_file(doc)
    data = bytearray((tag / shard["path"]).read_bytes())
    data[shard["partitions"][0]["data_offset"]] ^= 0x40
    (tag / shard["path"]).write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    refused(
        node(READER, manifest, tag, out),
        out,
        1,
        f"{shard['path']}: CK209 sha256 differs from the manifest (hint: restore the file the manifest describes)",
    )
    # --no-hash skips the files' hashes, not the tensors' digests: rank 1's first element is element
    # 954 of the group, inside l1.weight, whose digest refuses it.
    run = node(READER, "--no-hash", manifest, tag, out)
    assert run.returncode == 1 and run.stderr.startswith("l1.weight: CK222 ") and not out.exists()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_byte_flipped_in_a_real_element_fails_its_digest(damaged, tmp_path):
    """With the files' hashes skipped, the frozen parameter's digest still catches the flip (CK222)."""
    tag, manifest, doc = damaged
    model = doc["files"][0]
    loc = next(t for t in model["tensors"] if t["name"] == "frozen.bias")
    _flip(tag / model["path"], loc["data_offset"] + 2 * loc["numel"] - 1)  # the last element's high byte
    out = tmp_path / "out.safetensors"
    flipped = (tag / model["path"]).read_bytes()[loc["data_offset"] : loc["data_offset"] + 2 * loc["numel"]]
    recorded = next(f for f in doc["frozen"] if f["name"] == "frozen.bias")["digest"]["sha256"]
    refused(
        node(READER, "--no-hash", manifest, tag, out),
        out,
        1,
        f"frozen.bias: CK222 sha256 of the tensor's elements is {hashlib.sha256(flipped).hexdigest()[:16]}..., "
        f"the manifest records {recorded[:16]}... (hint: the tensor changed after the manifest was written; restore "
        "its file)",
    )


def test_a_byte_flipped_in_padding_is_not_a_finding(damaged, tmp_path):
    """Rank 1's master partition is a 951-element view of a 954-element storage: its last 3 elements
    are padding, outside every digest (and never read)."""
    tag, manifest, doc = damaged
    shard = optim_file(doc)
    loc = shard["partitions"][0]
    assert loc["member_size"] // 4 - loc["numel"] == 3
    _flip(tag / shard["path"], loc["data_offset"] + 4 * loc["numel"] + 5)
    out = tmp_path / "out.safetensors"
    assert node(READER, "--no-hash", manifest, tag, out).returncode == 0
    # The whole-file hash sees it, of course: that is why ZeRO-3 file hashes are not reproducible.
    assert node(READER, manifest, tag, tmp_path / "out2.safetensors").returncode == 1


def test_blake2b_hashes_are_verified(damaged, tmp_path):
    tag, manifest, doc = damaged
    for f in doc["files"]:  # blake2b digests from hashlib, not from the reader under test
        f["hash"] = {"algorithm": "blake2b", "digest": hashlib.blake2b((tag / f["path"]).read_bytes()).hexdigest()}
    manifest.write_text(json.dumps(doc), "utf-8")
    out = tmp_path / "out.safetensors"
    assert node(READER, manifest, tag, out).returncode == 0
    doc["files"][0]["hash"]["digest"] = "0" * 128
    manifest.write_text(json.dumps(doc), "utf-8")
    out.unlink()
    refused(
        node(READER, manifest, tag, out),
        out,
        1,
        f"{doc['files'][0]['path']}: CK209 blake2b differs from the manifest (hint: restore the file the manifest "
        "describes)",
    )


def test_locator_off_its_member(damaged, tmp_path):
    """A data_offset that fits the file but is not where the member starts (the zip header check)."""
    tag, manifest, doc = damaged
    loc = optim_file(doc)["partitions"][0]
    loc["data_offset"] -= 64
    manifest.write_text(json.dumps(doc), "utf-8")
    out = tmp_path / "out.safetensors"
    refused(
        node(READER, "--no-hash", manifest, tag, out),
        out,
        1,
        f"{optim_file(doc)['path']}: CK214 no zip entry {loc['member']} ends at byte {loc['data_offset']} "
        "(hint: regenerate the manifest from these files)",
    )


def test_invalid_manifest_is_refused_before_any_file_is_read(damaged, tmp_path):
    tag, manifest, doc = damaged
    doc["aliases"][0]["shape"] = doc["aliases"][0]["shape"][::-1]  # a transposed tie
    doc["groups"][0]["params"][0]["numel"] = "800"
    manifest.write_text(json.dumps(doc), "utf-8")
    out = tmp_path / "out.safetensors"
    refused(
        node(READER, manifest, tmp_path / "nowhere", out),
        out,
        1,
        f"{manifest}: $.groups[0].params[0].numel: CK001 must be integer "
        "(hint: the document breaks the JSON Schema rule 'type')",
    )
    doc["groups"][0]["params"][0]["numel"] = 800
    manifest.write_text(json.dumps(doc), "utf-8")
    refused(
        node(READER, manifest, tmp_path / "nowhere", out),
        out,
        1,
        f"{manifest}: $.aliases[0].shape: CK105 alias head.weight has shape [16,50], its owner [50,16] "
        "(hint: a tied tensor has its owner's shape)",
    )


@pytest.mark.parametrize(
    "edit,line",
    [
        (
            {"tensor_parallel_size": 2},
            "$.layout: CK402 the manifest describes one model-parallel rank, not the whole model "
            "(hint: this reader handles data parallelism only)",
        ),
        (
            {"partitions": []},
            "$.files: CK402 the manifest locates no partition "
            "(hint: generate the manifest from the checkpoint: `ckptspec generate CHECKPOINT`)",
        ),
    ],
)
def test_valid_manifests_this_reader_cannot_use(edit, line, damaged, tmp_path):
    """Valid for ckptspec, but not something the example can rebuild: refused, never half-read."""
    tag, manifest, doc = damaged
    for f in doc["files"]:
        f.update({k: v for k, v in edit.items() if k in f})
    doc["layout"].update({k: v for k, v in edit.items() if k in doc["layout"]})
    manifest.write_text(json.dumps(doc), "utf-8")
    report = CliRunner().invoke(cli, ["validate", str(manifest)])
    assert report.exit_code == 0, report.output
    out = tmp_path / "out.safetensors"
    refused(node(READER, manifest, tag, out), out, 1, line)


@pytest.mark.parametrize("case", ["usage", "no-manifest", "not-json", "not-utf8", "no-checkpoint", "unwritable"])
def test_usage_and_io_errors_exit_2(case, damaged, tmp_path):
    tag, manifest, _ = damaged
    out = tmp_path / "out.safetensors"
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{", "utf-8")
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"format": "caf\xe9"}')
    args, line = {
        "usage": ([manifest, tag], "usage: node reader.js [--no-hash] MANIFEST.json CHECKPOINT OUT.safetensors"),
        "no-manifest": (
            [tmp_path / "none.json", tag, out],
            f"{tmp_path / 'none.json'}: CK901 file not found (hint: check the path)",
        ),
        "not-json": (
            [garbage, tag, out],
            f"{garbage}: CK903 not valid JSON: Expected property name or '}}' in JSON at position 1 "
            "(hint: pass a JSON manifest (`ckptspec convert` makes one from msgpack))",
        ),
        "not-utf8": ([latin1, tag, out], f"{latin1}: CK903 not UTF-8 text (hint: save the manifest as UTF-8 JSON)"),
        "no-checkpoint": (
            [manifest, tmp_path / "none", out],
            f"{tmp_path / 'none'}: CK901 is not a directory (hint: pass the checkpoint (save or tag) directory)",
        ),
        "unwritable": ([manifest, tag, tmp_path / "no" / "out.safetensors"], None),
    }[case]
    run = node(READER, *args)
    assert run.returncode == 2 and run.stdout == ""
    if line is None:
        assert run.stderr.startswith(f"{tmp_path / 'no' / 'out.safetensors'}: CK906 cannot write: ENOENT")
        assert run.stderr.count("\n") == 1 and "    at " not in run.stderr
    else:
        assert run.stderr == line + "\n"


# --------------------------------------------------------------------------- dtype widening


def test_widening_is_exact_for_every_16_bit_pattern(tmp_path):
    """fp16 -> fp32 bit-identical to numpy (what ckptspec uses); bf16 -> fp32 to torch."""
    import torch

    bits = np.arange(65536, dtype=np.uint16)
    (tmp_path / "in.bin").write_bytes(bits.astype("<u2").tobytes())
    script = (
        "const fs = require('fs'); const { toFloat32 } = require(process.argv[1]);"
        "const raw = fs.readFileSync(process.argv[2]);"
        "for (const d of ['float16', 'bfloat16']) fs.writeFileSync(`${process.argv[3]}/${d}.bin`, toFloat32(raw, d));"
    )
    run = node("-e", script, NODE_DIR / "dtypes.js", tmp_path / "in.bin", tmp_path)
    assert run.returncode == 0, run.stderr
    widened = {d: np.frombuffer((tmp_path / f"{d}.bin").read_bytes(), "<u4") for d in ("float16", "bfloat16")}
    assert np.array_equal(widened["float16"], bits.view(np.float16).astype(np.float32).view(np.uint32))
    as_torch = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy().view(np.uint32)
    assert np.array_equal(widened["bfloat16"], as_torch)
    # torch quiets signalling fp16 NaNs (sets bit 22); numpy and this reader keep the payload.
    torch16 = torch.from_numpy(bits.view(np.int16).copy()).view(torch.float16).float().numpy().view(np.uint32)
    differ = bits[widened["float16"] != torch16]
    assert len(differ) == 1022 and all((b & 0x7C00) == 0x7C00 and not b & 0x200 for b in differ)


# --------------------------------------------------------------------------- the docs show the real code


def test_js_blocks_in_docs_are_excerpts_of_the_example():
    """Like test_docs' ```python excerpt=...: a ```js block is consecutive lines of a file this test runs."""
    fences = [
        (path, m)
        for path in sorted((ROOT / "docs").glob("*.md"))
        for m in re.finditer(r"^```js(?=[ \n])([^\n]*)\n(.*?)^```$", path.read_text("utf-8"), re.M | re.S)
    ]
    assert fences, "docs/loaders.md shows the reader's code"
    for path, m in fences:
        source = m.group(1).strip().removeprefix("excerpt=")
        assert source.startswith("examples/node-reader/"), (
            f"{path.name}: ```js{m.group(1)} is not `js excerpt=examples/node-reader/...`"
        )
        lines, want = (ROOT / source).read_text("utf-8").splitlines(), m.group(2).splitlines()
        windows = ("\n".join(lines[i : i + len(want)]) + "\n" for i in range(len(lines) - len(want) + 1))
        assert any(textwrap.dedent(w) == m.group(2) for w in windows), f"{path.name}: not an excerpt of {source}"
