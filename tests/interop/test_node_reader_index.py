"""examples/node-reader reads a checkpoint index too (issue #39): the whole model, bit for bit with Python.

For real tensor-parallel, pipeline, MoE, ZeRO stage-0 and universal checkpoints of the harness
(``PARALLEL`` in tests/_harness/scenarios.py): ``ckptspec generate --hash`` writes their checkpoint
index, ``node examples/node-reader/reader.js INDEX CHECKPOINT OUT.safetensors`` rebuilds the whole
model from the index's locators alone (each domain as a 1.x manifest, or through its ``masters``;
tensor-parallel slices merged, pipeline stages and experts put together), and every tensor must equal
``ckptspec reconstruct --untie``'s in name, shape, dtype and bytes. What the index does not locate
(the buffers of a stage-0 domain, which ckptspec reads from the pickled module) is named in the
output's ``ckptspec.absent`` metadata and is exactly what Node lacks. The ``EXTRAS`` checkpoints (AutoTP tp2 with
a frozen split weight, a frozen bias and two buffers; pp2 with a frozen weight, a buffer and a ``TiedLayerSpec``)
get a checkpoint index 1.1, which places those too (``extras``, ``aliases``): Node writes every tensor. A
corrupted index or a damaged file is refused by Node with the codes (and, for the document, the JSON paths)
``ckptspec validate`` reports, and nothing is written.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import EXTRAS, PARALLEL, hook_name
from click.testing import CliRunner
from safetensors import safe_open

from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node-reader"
READER = NODE_DIR / "reader.js"
UNIVERSAL = {"uc-s2-bf16-ws2", "uc-s3-bf16-ws2"}
MODEL_STATES = re.compile(r"^mp_rank_\d+_model_states\.pt$")
# pp2, pp2 x dp2, AutoTP tp2 (ZeRO 1-3), MoE ep2 (stages 0-2, ws 2 and 4), stage 0, universal; frozen, buffers, ties
POINTS = PARALLEL + EXTRAS
# the sidecars the save hook wrote (the live engine's topology, placements and members)
HOOKED = ["tp2dp2-s2-bf16-ws4", "pp2-s1-bf16-ws2", "moe-ep2-s1-fp32-ws4", "s0-bf16-ws2-fused"]


def node(*args: str | Path) -> subprocess.CompletedProcess:
    assert (NODE_DIR / "node_modules" / "ajv").is_dir(), "run ./scripts/env.sh (npm ci in examples/node-reader)"
    return subprocess.run(["node", *map(str, args)], capture_output=True, text=True, timeout=120)


def ckptspec(*args: str | Path, status: int = 0) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == status, result.output
    return result.stdout


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def tag_dir(ds, name: str) -> Path:
    """The tag directory of a PARALLEL entry: DeepSpeed's save, or ds_to_universal's folder."""
    info = ds.read_json(name, "parallel.json")
    return ds.path(name) / (info["universal"]["output_folder"] if name in UNIVERSAL else info["tag"])


def masters_buffers(doc: dict) -> dict[str, str]:
    """The buffers of the domains whose index locates their masters (ckptspec reads them from the
    pickled module, the index locates them nowhere) -> why Node must name them absent."""
    out = {}
    for d in doc["domains"]:
        model = next((f["path"] for f in d["manifest"]["files"] if MODEL_STATES.match(f["path"])), None)
        for b in d["manifest"]["buffers"] if "masters" in d else []:
            out[b["name"]] = f"buffer: not located by the checkpoint index (in the pickled module of {model})"
    return out


def assert_same_model(index: Path, tag: Path, tmp_path: Path) -> tuple[dict, dict, dict]:
    """Node's output equals ckptspec's, tensor by tensor and byte for byte, but for what it names absent."""
    out = tmp_path / "node.safetensors"
    run = node(READER, index, tag, out)
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    ckptspec("reconstruct", "-q", "--untie", "--manifest", index, tag, tmp_path / "ref")
    doc = json.loads(index.read_text("utf-8"))
    mine, my_meta = load(out)
    ref, ref_meta = load(tmp_path / "ref" / "model.safetensors")
    absent = json.loads(my_meta["ckptspec.absent"])
    assert absent == masters_buffers(doc)
    assert set(mine) | set(absent) == set(ref) and not set(mine) & set(absent)
    assert {p["name"] for p in doc["parameters"]} <= set(mine)
    for name, tensor in mine.items():
        assert (tensor.dtype, tensor.shape) == (ref[name].dtype, ref[name].shape), name
        assert tensor.tobytes() == ref[name].tobytes(), f"{name} differs"
    assert json.loads(my_meta["ckptspec.aliases"]) == json.loads(ref_meta["ckptspec.aliases"])
    assert my_meta["ckptspec.parallel"] == ref_meta["ckptspec.parallel"]
    ties = len(json.loads(my_meta["ckptspec.aliases"]))
    assert run.stdout.splitlines()[0] == f"{out}: {len(mine)} tensors ({ties} of them tied aliases, written as copies)"
    return doc, mine, absent


@pytest.mark.parametrize("point", POINTS)
def test_node_reader_rebuilds_the_whole_model_of_an_index(point, ds, tmp_path):
    tag = tag_dir(ds, point)
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index, "--hash")
    doc, mine, absent = assert_same_model(index, tag, tmp_path)
    assert doc["format"] == "ckptspec.checkpoint"
    placements = {json.dumps(s["placement"])[:9] for p in doc["parameters"] for s in p["shards"]}
    if point.startswith("tp2"):  # AutoTP: column- and row-parallel slices merged, the head replicated
        assert placements == {'{"split":', '"replicat'}
    if point.startswith("pp2"):  # each stage's layers, from its own domain
        assert {s["domain"] for p in doc["parameters"] for s in p["shards"]} == {"pp0-tp0", "pp1-tp0"}
    if point.startswith("moe"):  # every expert of every expert-parallel rank
        assert any(d["id"].startswith("expert:") for d in doc["domains"]) and doc["expert_files"]
    if point == "s0-bf16-ws2-fused":  # its buffers are in the pickled module only
        assert sorted(absent) == ["running", "step_count"]
    if point in EXTRAS:  # index 1.1: every frozen parameter, buffer and tie placed in the document
        assert doc["format_version"] == "1.1.0" and not absent
        roles = {e["name"]: e["role"] for e in doc["extras"]}
        if point.endswith("-tied"):  # AutoTP: a weight it leaves whole, tied (no frozen parameter, no buffer)
            assert roles == {} and doc["aliases"] == {"out.weight": "inp.weight"}
        elif point.startswith("tp2"):
            frozen, buffers = ["blocks.0.up.weight", "head.bias"], ["running", "step_count"]
            assert roles == {**dict.fromkeys(frozen, "frozen"), **dict.fromkeys(buffers, "buffer")}
        else:  # the pipeline: a layer file's bytes through each shard's locator, the tie across stages
            tie = {f"{layer}.{key}": role for layer in (0, 4) for key, role in (("gain", "frozen"), ("seen", "buffer"))}
            assert roles == {"2.up.weight": "frozen", "3.running": "buffer", **tie}
            assert doc["aliases"] == {"4.weight": "0.weight"}
            assert all("locator" in s for e in doc["extras"] for s in e["shards"])
        assert set(roles) | set(doc.get("aliases", {})) <= set(mine)
    else:
        assert doc["format_version"] == "1.0.0" and "extras" not in doc


def test_node_reader_rebuilds_a_tensor_parallel_pipeline_with_a_tie_frozen_shards_and_buffers(ds, tmp_path):
    """The tp2 x pp2 pipeline with the plain pipeline's extras (scenarios.TP_PIPE_EXTRAS_SPECS): the tie's shards on
    every stage and tensor rank, the frozen column-parallel weight's shards put together along dim 0 from their layer
    files' locators, the buffers replicated: every tensor, as ckptspec reconstructs it."""
    point = "tp2pp2-s1-fp32-ws4-extras"
    tag = tag_dir(ds, point)
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index, "--hash")
    doc, mine, absent = assert_same_model(index, tag, tmp_path)
    assert doc["format_version"] == "1.1.0" and not absent and doc["aliases"] == {"4.weight": "0.weight"}
    frozen = next(e for e in doc["extras"] if e["name"] == "2.up.weight")
    assert [s["placement"]["split"]["axis"] for s in frozen["shards"]] == [0, 0]
    assert mine["2.up.weight"].shape == (32, 16)
    assert {"0.seen", "4.seen", "3.running", "0.gain", "4.gain"} <= set(mine)


@pytest.mark.parametrize("point", ["s2-bf16-ws2", "s3-fp16-ws3-groups"])
def test_node_reader_reads_a_universal_folder_with_ties_frozen_parameters_and_buffers(point, ds, tmp_path):
    """`ckptspec export-universal` of matrix checkpoints: the tie written as a copy of its owner, the frozen
    parameters' fp32.pt read as the others, the buffers (in the copied model states' pickle) named absent."""
    folder = tmp_path / "uc"
    ckptspec("export-universal", ds.path(point), folder)
    index = tmp_path / "index.json"
    ckptspec("generate", folder, "-o", index, "--hash")
    doc, mine, absent = assert_same_model(index, folder, tmp_path)
    assert doc["kind"] == "universal" and sorted(absent) == ["running", "step_count"]
    assert {"frozen.weight", "head.weight"} <= set(mine)
    assert mine["head.weight"].tobytes() == mine["emb.weight"].tobytes()


@pytest.mark.parametrize("point", HOOKED)
def test_node_reader_reads_the_index_the_save_hook_wrote(point, ds, tmp_path):
    """The sidecar `ckptspec.save_checkpoint` wrote (the live engine's topology, placements, members)."""
    save_dir = ds.path(hook_name(point))
    tag = save_dir / (save_dir / "latest").read_text().strip()
    assert_same_model(tag / "ckptspec.json", save_dir, tmp_path)


# --------------------------------------------------------------------------- refusals


def findings(run: subprocess.CompletedProcess, index: Path) -> set[tuple[str, str]]:
    """(code, JSON path) of each error Node printed about the document."""
    line = re.compile(rf"^{re.escape(str(index))}: (\$\S*): (CK\d\d\d) ")
    return {(m.group(2), m.group(1)) for m in map(line.match, run.stderr.splitlines()) if m}


def python_errors(*args: str | Path) -> set[tuple[str, str]]:
    report = json.loads(ckptspec("validate", *args, "--format", "json", status=1))
    return {(f["code"], f["path"]) for f in report["findings"] if f["severity"] == "error"}


def _set(doc: dict, path: str, value) -> None:
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
    for p in parents:
        doc = doc[p]
    doc[last] = value


# (point, JSON pointer, new value, the code both must report)
CORRUPTIONS = [
    ("tp2-s1-fp32-ws2", "format_version", "2.0.0", "CK003"),
    ("tp2-s1-fp32-ws2", "topology/model_parallel_size", 0, "CK001"),
    ("tp2-s1-fp32-ws2", "parameters/0/shards/0/placement", "sideways", "CK001"),
    ("tp2-s1-fp32-ws2", "domains/1/manifest/groups/0/params/0/numel", 255, "CK101"),
    ("tp2-s1-fp32-ws2", "topology/degrees/tensor", 1, "CK602"),
    ("tp2-s1-fp32-ws2", "domains/0/file_ranks/mp_rank_00_model_states.pt", 1, "CK603"),
    ("tp2-s1-fp32-ws2", "parameters/0/shards/1/placement/split/offset", 8, "CK605"),
    ("tp2-s1-fp32-ws2", "parameters/0/shards/0/local_name", "blocks.0.up.bias", "CK606"),
    ("tp2-s1-fp32-ws2", "parameters/0/placement_source", "none", "CK608"),
    ("pp2-s1-bf16-ws2", "layer_files/1/pipeline", 2, "CK607"),
    ("moe-ep2-s1-fp32-ws2", "domains/1/manifest/files/0/size", 1, "CK604"),
    ("moe-ep2-s0-bf16-ws2", "domains/0/masters/tensors/0/dtype", "bfloat16", "CK609"),
    ("tp2-s1-fp32-ws2-extras", "extras/2/shards/0/local_name", "runnin", "CK610"),
    ("pp2-s1-fp32-ws2-extras", "extras/0/shards/0/locator/numel", 511, "CK610"),
    ("pp2-s1-fp32-ws2-extras", "aliases/4.weight", "0.bias", "CK610"),
    ("tp2-s2-bf16-ws2-extras", "extras/0/shards/1/placement/split/offset", 0, "CK605"),
]


@pytest.mark.parametrize("point,pointer,value,code", CORRUPTIONS, ids=[f"{c[3]}-{c[1]}" for c in CORRUPTIONS])
def test_a_corrupted_index_is_refused_as_ckptspec_refuses_it(point, pointer, value, code, ds, tmp_path):
    tag = tag_dir(ds, point)
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index)
    doc = json.loads(index.read_text("utf-8"))
    _set(doc, pointer, value)
    index.write_text(json.dumps(doc), "utf-8")
    out = tmp_path / "out.safetensors"
    run = node(READER, index, tag, out)
    assert (run.returncode, run.stdout) == (1, "") and not out.exists(), run.stderr
    mine = findings(run, index)
    assert code in {c for c, _ in mine} and mine == python_errors(index), run.stderr


def _truncate(tag: Path, doc: dict) -> str:
    shard = next(f for f in doc["domains"][1]["manifest"]["files"] if f["role"] == "optimizer_states")
    with open(tag / shard["path"], "r+b") as f:
        f.truncate(shard["size"] - 100)
    return f"{shard['path']}: CK208 is {shard['size'] - 100} bytes, the manifest says {shard['size']} "


def _lose_layer_file(tag: Path, doc: dict) -> str:
    lf = doc["layer_files"][2]
    (tag / lf["path"]).unlink()
    return f"{lf['path']}: $.layer_files[2]: CK230 pipeline layer file of layer {lf['layer']} (stage {lf['pipeline']}) "


def _lose_expert_file(tag: Path, doc: dict) -> str:
    ef = doc["expert_files"][1]
    (tag / ef["path"]).unlink()
    return f"{ef['path']}: $.expert_files[1]: CK240 expert file of MoE layer {ef['moe_layer']}, expert {ef['expert']} "


def _flip_master_copy(tag: Path, doc: dict) -> str:
    """One bit of a saved copy of a dense master (no hashes: only the comparison can tell)."""
    copy = next(d for d in doc["domains"] if d["id"] == "dense")["replicas"][0]
    data = bytearray((tag / copy["file"]).read_bytes())
    data[copy["data_offset"] + 4 * copy["element_offset"] + 1] ^= 0x10
    (tag / copy["file"]).write_bytes(bytes(data))
    return f"{copy['file']}: CK243 the copy of {copy['param']}'s fp32 master differs from the master "


DAMAGES = [
    ("tp2-s1-fp32-ws2", _truncate, True),
    ("pp2-s1-bf16-ws2", _lose_layer_file, True),
    ("moe-ep2-s0-bf16-ws2", _lose_expert_file, True),
    ("moe-ep2-s0-bf16-ws2", _flip_master_copy, False),
]


@pytest.mark.parametrize("point,damage,hashed", DAMAGES, ids=[d[1].__name__.strip("_") for d in DAMAGES])
def test_damaged_files_are_refused_as_ckptspec_refuses_them(point, damage, hashed, ds, tmp_path):
    """Node's one-line refusal carries the error ckptspec's validation of the same files reports."""
    tag = tmp_path / "tag"
    shutil.copytree(tag_dir(ds, point), tag)
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index, *(["--hash"] if hashed else []))
    want = damage(tag, json.loads(index.read_text("utf-8")))
    out = tmp_path / "out.safetensors"
    run = node(READER, index, tag, out)
    assert (run.returncode, run.stdout, run.stderr.count("\n")) == (1, "", 1) and not out.exists(), run.stderr
    assert run.stderr.startswith(want), run.stderr
    code = re.search(r" (CK\d\d\d) ", want).group(1)
    assert code in {c for c, _ in python_errors(index, "--checkpoint", tag)}


def test_a_flipped_element_of_a_tensor_parallel_slice_fails_its_digest(ds, tmp_path):
    """Without the files' hashes, each shard's digest (its domain manifest's, `--hash`) still catches a
    flipped bit in a slice that is merged into a whole tensor (ckptspec checks split shards' digests only
    in `validate`)."""
    tag = tmp_path / "tag"
    shutil.copytree(tag_dir(ds, "tp2-s1-fp32-ws2"), tag)
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index, "--hash")
    manifest = json.loads(index.read_text("utf-8"))["domains"][1]["manifest"]
    loc = next(f for f in manifest["files"] if f["partitions"])["partitions"][0]
    path = tag / next(f for f in manifest["files"] if f["partitions"])["path"]
    data = bytearray(path.read_bytes())
    data[loc["data_offset"] + 4 * loc["element_offset"] + 3] ^= 0x01  # element 0's sign bit
    path.write_bytes(bytes(data))
    first = manifest["groups"][0]["params"][0]
    assert first["offset"] == 0 and "digest" in first
    out = tmp_path / "out.safetensors"
    run = node(READER, "--no-hash", index, tag, out)
    assert (run.returncode, run.stdout) == (1, "") and not out.exists()
    assert run.stderr.startswith(f"{first['name']}: CK222 sha256 of the tensor's elements is "), run.stderr


def test_affine_pieces_compose_as_the_split_they_describe(ds, tmp_path):
    """DeepSpeed's affine `pieces` (strided views) give the same whole tensors as the one-axis split
    they restate: the column-parallel (axis 0) and row-parallel (axis 1) slices of AutoTP."""
    tag = tag_dir(ds, "tp2-s1-fp32-ws2")
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index, "--hash")
    doc = json.loads(index.read_text("utf-8"))
    rewritten = 0
    for param in doc["parameters"]:
        for shard in param["shards"]:
            if "split" not in shard["placement"]:
                continue
            axis, offset = shard["placement"]["split"]["axis"], shard["placement"]["split"]["offset"]
            shape, local = param["shape"], shard["local_shape"]
            whole_strides = [int(np.prod(shape[a + 1 :])) for a in range(len(shape))]
            local_strides = [int(np.prod(local[a + 1 :])) for a in range(len(local))]
            source = [offset * whole_strides[axis], whole_strides]
            shard["placement"] = {"pieces": [{"shape": local, "source": source, "dest": [0, local_strides]}]}
            rewritten += 1
    assert rewritten >= 8
    index.write_text(json.dumps(doc), "utf-8")
    assert_same_model(index, tag, tmp_path)
    ref, _ = load(tmp_path / "ref" / "model.safetensors")
    (tmp_path / "ref").rename(tmp_path / "pieces")
    (tmp_path / "node.safetensors").unlink()
    split = tmp_path / "split.json"
    ckptspec("generate", tag, "-o", split, "--hash")
    assert_same_model(split, tag, tmp_path)
    assert {k: v.tobytes() for k, v in load(tmp_path / "node.safetensors")[0].items()} == {
        k: v.tobytes() for k, v in ref.items()
    }


def test_the_committed_indexes_are_judged_by_node_as_by_ckptspec(tmp_path):
    """tests/conformance/index-1.0 (the indexes of three real harness checkpoints: validate.js dispatches
    on `format`) are valid; a shard that claims the whole of a tp2 split parameter is CK605 for both."""
    from ckptspec.format.index_validate import validate_index_document

    fixtures = sorted((ROOT / "tests" / "conformance" / "index-1.0").glob("*.json"))
    tp = json.loads((ROOT / "tests" / "conformance" / "index-1.0" / "tp2dp2-s2-bf16-ws4.json").read_text("utf-8"))
    tp["parameters"][0]["shards"][0]["placement"] = "whole"
    (tmp_path / "mixed.json").write_text(json.dumps(tp), "utf-8")
    run = node(NODE_DIR / "validate.js", *fixtures, tmp_path / "mixed.json")
    assert (run.returncode, run.stderr) == (1, ""), run.stderr
    verdicts = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(v["file"], v["raw_valid"], v["codes"], v["warnings"]) for v in verdicts] == [
        *[(str(f), True, [], []) for f in fixtures],
        (str(tmp_path / "mixed.json"), True, ["CK605"], []),
    ]
    assert {f.code for f in validate_index_document(tp).findings} == {"CK605"}


# --------------------------------------------------------------------------- index 1.1 against 1.0


def as_1_0(doc: dict) -> dict:
    """The 1.1 index as a 1.0 one (what an earlier ckptspec wrote): no extras, aliases or locators."""
    doc = json.loads(json.dumps(doc))
    doc["format_version"] = "1.0.0"
    doc.pop("extras"), doc.pop("aliases")
    return doc


@pytest.mark.parametrize("point", EXTRAS)
def test_a_1_0_index_leaves_node_the_trainables_and_names_the_rest_absent(point, ds, tmp_path):
    """Before index 1.1, Node refused these indexes (tp2: CK401, each rank's frozen parameters under their local
    names) or silently wrote 10 of the pipeline's 13 tensors. From a 1.0 index it now writes what the document
    locates, bit for bit with ckptspec (which reads the pickles for the rest), and names every other tensor."""
    tag = tag_dir(ds, point)
    full = tmp_path / "full.json"
    ckptspec("generate", tag, "-o", full, "--hash")
    doc = json.loads(full.read_text("utf-8"))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(as_1_0(doc)), "utf-8")
    out = tmp_path / "node.safetensors"
    run = node(READER, old, tag, out)
    assert (run.returncode, run.stderr) == (0, ""), run.stderr
    ckptspec("reconstruct", "-q", "--untie", "--manifest", old, tag, tmp_path / "ref")
    mine, meta = load(out)
    ref, _ = load(tmp_path / "ref" / "model.safetensors")
    absent = json.loads(meta["ckptspec.absent"])
    # a pipeline's ties: the layer files say them; a tensor-parallel domain's are named absent with the extras
    pipeline = bool(doc["layer_files"])
    assert set(absent) == {e["name"] for e in doc["extras"]} | (set() if pipeline else set(doc.get("aliases", {})))
    assert set(mine) == set(ref) - set(absent)
    assert json.loads(meta["ckptspec.aliases"]) == (doc.get("aliases", {}) if pipeline else {})
    for name, tensor in mine.items():
        assert tensor.tobytes() == ref[name].tobytes(), name
    ckptspec("reconstruct", "-q", "--untie", "--manifest", full, tag, tmp_path / "ref11")
    ref11, _ = load(tmp_path / "ref11" / "model.safetensors")  # ckptspec: the document's placements = its own
    assert {k: v.tobytes() for k, v in ref11.items()} == {k: v.tobytes() for k, v in ref.items()}


def test_a_wrong_layer_file_locator_is_refused_by_both(ds, tmp_path):
    """A 1.1 locator four bytes off its member: Node finds no zip entry ending there (CK214), ckptspec that the
    layer file's pickle does not put the key there (CK401); neither writes anything."""
    tag = tag_dir(ds, "pp2-s1-fp32-ws2-extras")
    index = tmp_path / "index.json"
    ckptspec("generate", tag, "-o", index)
    doc = json.loads(index.read_text("utf-8"))
    frozen = next(e for e in doc["extras"] if e["name"] == "2.up.weight")  # a layer's own frozen parameter
    loc = frozen["shards"][0]["locator"]
    loc["data_offset"] += 4
    index.write_text(json.dumps(doc), "utf-8")
    ckptspec("validate", index)  # the document alone cannot tell: its schema and rules accept it
    out = tmp_path / "out.safetensors"
    run = node(READER, index, tag, out)
    assert (run.returncode, run.stdout) == (1, "") and not out.exists()
    assert run.stderr.startswith(f"layer_02-model_states.pt: CK214 no zip entry {loc['member']} ends at byte "), (
        run.stderr
    )
    result = CliRunner().invoke(cli, ["reconstruct", "-q", "--manifest", str(index), str(tag), str(tmp_path / "ref")])
    assert result.exit_code == 1 and "CK401" in result.output and "2.up.weight" in result.output, result.output
    assert not (tmp_path / "ref").exists()
