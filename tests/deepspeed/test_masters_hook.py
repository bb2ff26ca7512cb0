"""Issue #17 (and #16's stage-0 pipeline): the live-engine producer and the save hook of the kinds whose
index locates fp32 masters: ZeRO stage 0 (fp32; bf16 and fp16 with FP16_UnfusedOptimizer and with
FP16_Optimizer), native MoE ep2 at world size 2 and 4 (stages 0, 1, 2; fp32 and bf16), the stage-0
BF16_Optimizer pipeline (and, #40, the tensor x pipeline one: Megatron-style layers, its split rules in the client
state).

The ``+hook`` entries (tests/_harness/scenarios.py MASTERS_HOOKED) re-train the PARALLEL job in its
launch and save it through ``ckptspec.deepspeed.save_checkpoint``; every rank also wrote the live
engine's index without files (``engine_index.index_from_engine``) and the index the hook returned.
Held against: the index generated from the saved directory without DeepSpeed, DeepSpeed's own rank
grid and expert groups (``parallel.json``), the live masters every rank gathered (experts from the
rank that owns them), and the reconstruction of the checkpoint DeepSpeed saved itself.
"""

import copy
import json
import shutil

import pytest
from _harness.parallel_oracles import bits_equal, check_masters, info, rank_oracles
from _harness.reconstruction import invoke
from _harness.scenarios import MASTERS_HOOKED, hook_name

from ckptspec.deepspeed.describe import describe

# What only the live engine knows, compared apart: the global rank of every coordinate
# (topology.ranks, domains[].members) and that the engine is the source of the degrees. The
# directory derives the degrees (or reads checkpoint_parallel_dimensions) and knows no global rank.
ENGINE_ONLY = "topology.ranks, topology.degrees_source, domains[].members"
# What only the files know, left out of the live index (no files yet): the files of each domain
# (file_ranks, manifest.files), where the masters and their copies are (byte ranges of saved files:
# masters, replicas), the expert files and pipeline layer files with their sizes and hashes.
FILES_ONLY = "domains[].file_ranks, domains[].manifest.files, domains[].masters, domains[].replicas, "
FILES_ONLY += "expert_files, layer_files"


def _engine_only(doc: dict) -> tuple[dict, dict]:
    doc = copy.deepcopy(doc)
    topo = doc["topology"]
    apart = {"ranks": topo.pop("ranks", None), "degrees_source": topo.pop("degrees_source")}
    apart["members"] = [d.pop("members", None) for d in doc["domains"]]
    return doc, apart


def _ranks(entry, prefix):
    return [json.loads((entry / f"{prefix}.rank{r}.json").read_text()) for r in range(info(entry)["world_size"])]


@pytest.mark.parametrize("name", MASTERS_HOOKED)
def test_the_hooks_index_is_the_one_generated_from_the_directory(ds, name):
    entry = ds.path(hook_name(name))
    tag_dir = entry / info(entry)["tag"]
    saved = _ranks(entry, "saved_index")
    assert all(doc == saved[0] for doc in saved), "ranks returned different indexes"
    assert json.loads((tag_dir / "ckptspec.json").read_text()) == saved[0]  # the sidecar is what it returned
    from_dir = describe(entry, hash_algorithm="sha256").to_dict()
    (hooked, live_only), (generated, dir_only) = _engine_only(saved[0]), _engine_only(from_dir)
    assert hooked == generated
    assert all(d["masters"]["tensors"] for d in saved[0]["domains"])
    assert live_only["degrees_source"] == "engine" and dir_only["degrees_source"] != "engine"
    assert dir_only["ranks"] is None and dir_only["members"] == [None] * len(saved[0]["domains"])


@pytest.mark.parametrize("name", MASTERS_HOOKED)
def test_the_live_engines_index_is_the_layout_the_hook_completed(ds, name):
    """index_from_engine (no files) agrees on every rank and is the saved index without FILES_ONLY (and
    without the digests the hook took of the saved masters and moments)."""
    entry = ds.path(hook_name(name))
    live = _ranks(entry, "engine_index")
    assert all(doc == live[0] for doc in live)
    saved = copy.deepcopy(_ranks(entry, "saved_index")[0])
    assert live[0]["layer_files"] == [] and live[0].get("expert_files") in (None, [])
    assert bool(saved["layer_files"]) == name.startswith(("pp2", "tp2pp2")) and bool(saved.get("expert_files")) == (
        name.startswith("moe")
    )
    saved["layer_files"] = []
    if "expert_files" in saved:
        saved["expert_files"] = []
    for dom in saved["domains"]:
        assert dom["file_ranks"] and dom["manifest"]["files"] and dom.pop("masters")
        dom["file_ranks"], dom["manifest"]["files"] = {}, []
        dom.pop("replicas", None)
        for group in dom["manifest"]["groups"]:  # digests of the saved bytes (#39): every master's and moment's
            for p in group["params"]:
                assert p.pop("digest") and p.pop("state_digests")
    assert saved == live[0]


@pytest.mark.parametrize("name", MASTERS_HOOKED)
def test_the_engine_records_deepspeeds_rank_grid_and_expert_groups(ds, name):
    entry = ds.path(hook_name(name))
    index, meta = _ranks(entry, "saved_index")[0], info(entry)
    reported = {r["rank"]: r for r in meta["ranks"]}  # what DeepSpeed's groups said in the job
    for coord in index["topology"]["ranks"]:
        ds_rank = reported[coord["rank"]]
        assert (coord["pipeline"], coord["tensor"], coord["data"], coord["mp_rank"]) == (
            ds_rank["pp"],
            ds_rank["tp"],
            ds_rank["dp"],
            ds_rank["checkpoint_mp_rank"],
        )
        assert coord.get("expert") == ds_rank.get("ep")
    stage = meta["spec"]["stage"]
    for dom in index["domains"]:
        if dom["id"].startswith("expert:"):
            e = dom["coordinate"]["expert"]
            (group,) = {tuple(r["edp_group"]) for r in meta["ranks"] if r["ep"] == e}
            # stage 1/2: partitioned over the expert-data-parallel group; stage 0: saved by its rank 0
            assert dom["members"] == (list(group) if stage else [group[0]])
        elif dom["id"] == "dense":
            assert dom["members"] == (sorted(reported) if stage else [0])
        else:  # a pipeline stage (of a tensor rank): its data-parallel ranks
            p, t = dom["coordinate"]["pipeline"], dom["coordinate"]["tensor"]
            assert dom["members"] == [r for r, c in sorted(reported.items()) if (c["pp"], c["tp"]) == (p, t)]


@pytest.mark.parametrize("name", ["s0-bf16-ws2", "moe-ep2-s1-bf16-ws4", "pp2-s0-bf16-ws2", "tp2pp2-s0-bf16-ws4"])
def test_validate_dir_checks_the_files_against_the_hooks_sidecar(ds, name, tmp_path):
    entry = ds.path(hook_name(name))
    result = invoke("validate", str(entry), "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout)["findings"] == [], result.stdout
    tag = info(entry)["tag"]
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(entry / tag, copy_dir / tag)
    (copy_dir / "latest").write_text(tag)
    sidecar = copy_dir / tag / "ckptspec.json"
    doc = json.loads(sidecar.read_text())
    victim = doc["domains"][-1]["manifest"]["files"][-1]
    for dom in doc["domains"]:  # a file two domains share (MoE) has one hash in both (CK604 otherwise)
        for f in dom["manifest"]["files"]:
            if f["path"] == victim["path"]:
                f["hash"]["digest"] = "0" * 64  # only the sidecar's hashes can say this
    sidecar.write_text(json.dumps(doc))
    result = invoke("validate", str(copy_dir), "--format", "json")
    codes = {(f["code"], f.get("file")) for f in json.loads(result.stdout)["findings"]}
    assert result.exit_code == 1 and ("CK209", victim["path"]) in codes, result.stdout
    sidecar.unlink()  # generated from the files instead: no recorded hash to disagree with
    assert invoke("validate", str(copy_dir)).exit_code == 0


@pytest.mark.parametrize("name", MASTERS_HOOKED)
def test_the_hooked_checkpoint_reconstructs_to_the_live_masters(ds, name, tmp_path):
    """Bit for bit: every rank's master of the hooked job (each expert on the rank that owns it), and
    the reconstruction of the checkpoint DeepSpeed saved itself in the first run of the job."""
    from safetensors.torch import load_file

    entry, original = ds.path(hook_name(name)), ds.path(name)
    wholes = []
    for source in (entry, original):
        out = tmp_path / source.name
        result = invoke("reconstruct", str(source), str(out), "--quiet")
        assert result.exit_code == 0, result.stderr
        wholes.append(load_file(out / "model.safetensors"))
    hooked, native = wholes
    buffers = rank_oracles(entry)[0].get("buffers", {})  # the module's, as the job held them
    assert check_masters(entry, hooked) >= len(hooked) - len(buffers)
    assert all(bits_equal(hooked[n], b) for n, b in buffers.items())
    assert list(hooked) == list(native) and all(bits_equal(hooked[n], native[n]) for n in hooked)
