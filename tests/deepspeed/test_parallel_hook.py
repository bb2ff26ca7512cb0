"""Issue #16, the live-engine producer and the save hook of tensor/pipeline-parallel engines.

The ``+hook`` entries (tests/_harness/scenarios.py HOOKED) re-train a PARALLEL (or TP_PIPE_SPECS) job in its own launch
and save it through ``ckptspec.deepspeed.save_checkpoint``; every rank also wrote the live engine's
index without files (``engine_index.index_from_engine``) and the complete index the hook returned.
Held against: the index generated from the saved directory without DeepSpeed, DeepSpeed's own rank
grid (``parallel.json``), the live masters every rank gathered, and the reconstruction of the
checkpoint DeepSpeed saved itself (which test_parallel_index.py holds against ds_to_universal).
"""

import copy
import json
import shutil

import pytest
from _harness.parallel_oracles import bits_equal, check_masters, info, rank_oracles
from _harness.reconstruction import invoke
from _harness.scenarios import HOOKED, hook_name

from ckptspec.deepspeed.describe import describe

# What only the live engine knows, compared apart: the global rank of every coordinate
# (topology.ranks, domains[].members), that the engine is the source of the degrees and of the
# tensor-parallel placements, and the optimizer's class (the files say "unknown").
ENGINE_ONLY = "topology.ranks, topology.degrees_source, domains[].members, domains[].manifest.optimizer.class, "
ENGINE_ONLY += "parameters[].placement_source"


def _engine_only(doc: dict) -> tuple[dict, dict]:
    """(doc without the ENGINE_ONLY fields, those fields)."""
    doc = copy.deepcopy(doc)
    topo = doc["topology"]
    apart = {"ranks": topo.pop("ranks", None), "degrees_source": topo.pop("degrees_source")}
    apart["members"] = [d.pop("members", None) for d in doc["domains"]]
    apart["class"] = [d["manifest"].get("optimizer", {}).pop("class", None) for d in doc["domains"]]
    apart["placement_source"] = sorted({p.pop("placement_source") for p in doc["parameters"]})
    return doc, apart


def _ranks(entry, prefix):
    return [json.loads((entry / f"{prefix}.rank{r}.json").read_text()) for r in range(info(entry)["world_size"])]


@pytest.mark.parametrize("name", HOOKED)
def test_the_hooks_index_is_the_one_generated_from_the_directory(ds, name):
    entry = ds.path(hook_name(name))
    tag_dir = entry / info(entry)["tag"]
    saved = _ranks(entry, "saved_index")
    assert all(doc == saved[0] for doc in saved), "ranks returned different indexes"
    assert json.loads((tag_dir / "ckptspec.json").read_text()) == saved[0]  # the sidecar is what it returned
    from_dir = describe(entry, hash_algorithm="sha256").to_dict()
    (hooked, live_only), (generated, dir_only) = _engine_only(saved[0]), _engine_only(from_dir)
    assert hooked == generated
    spec = info(entry)["spec"]
    # AutoTP's placements are the live engine's (its affine map); a tensor x pipeline engine's, like the files', the
    # split rules of the client state its save was given
    tp_source = ["engine"] if spec["tp"] > 1 else ["pipeline_layer"]
    dir_source = ["affine_map"] if spec["tp"] > 1 else ["pipeline_layer"]
    if spec["tp"] > 1 and spec["pp"] > 1:
        tp_source = dir_source = ["universal_checkpoint_info"]
    assert (live_only["degrees_source"], live_only["placement_source"]) == ("engine", tp_source)
    assert (dir_only["degrees_source"], dir_only["placement_source"]) == ("checkpoint_parallel_dimensions", dir_source)
    assert set(live_only["class"]) == {"torch.optim.adam.Adam"} and set(dir_only["class"]) == {"unknown"}
    assert dir_only["ranks"] is None and dir_only["members"] == [None] * len(saved[0]["domains"])


@pytest.mark.parametrize("name", HOOKED)
def test_the_live_engines_index_is_the_layout_the_hook_completed(ds, name):
    """index_from_engine (no files) agrees on every rank and is the saved index without its files."""
    entry = ds.path(hook_name(name))
    live = _ranks(entry, "engine_index")
    assert all(doc == live[0] for doc in live)
    saved = copy.deepcopy(_ranks(entry, "saved_index")[0])
    spec = info(entry)["spec"]
    # parallel_models._pipe_layers (job/tp_layers.py's: a file per layer and tensor rank)
    layers = (6 if spec["tied"] else 5) * spec["tp"] if spec["pp"] > 1 else 0
    assert live[0]["layer_files"] == [] and len(saved["layer_files"]) == layers
    saved["layer_files"] = []
    if "extras" in saved:  # index 1.1's extras and ties are placed from the saved files (with_extras)
        assert saved["format_version"] == "1.1.0" and (saved.pop("extras") or saved.pop("aliases"))
        saved.pop("aliases", None)
        saved["format_version"] = live[0]["format_version"]
    for dom in saved["domains"]:
        assert dom["file_ranks"] and dom["manifest"]["files"]
        dom["file_ranks"], dom["manifest"]["files"] = {}, []
        for group in dom["manifest"]["groups"]:  # tensor digests are read from the files
            for param in group["params"]:
                assert param.pop("digest") and param.pop("state_digests")
        for extra in dom["manifest"]["frozen"] + dom["manifest"]["buffers"]:
            assert extra.pop("digest")
    assert saved == live[0]


@pytest.mark.parametrize("name", HOOKED)
def test_the_engine_records_deepspeeds_rank_grid(ds, name):
    entry = ds.path(hook_name(name))
    index = _ranks(entry, "saved_index")[0]
    reported = sorted(
        (r["rank"], r["pp"], r["tp"], r["dp"], r["checkpoint_mp_rank"]) for r in info(entry)["ranks"]
    )  # what DeepSpeed's grid/groups said in the job
    recorded = sorted(
        (r["rank"], r["pipeline"], r["tensor"], r["data"], r["mp_rank"]) for r in index["topology"]["ranks"]
    )
    assert recorded == reported
    for dom in index["domains"]:
        coord = (dom["coordinate"]["pipeline"], dom["coordinate"]["tensor"])
        assert dom["members"] == [r for r, p, t, d, _ in sorted(reported, key=lambda x: x[3]) if (p, t) == coord]


@pytest.mark.parametrize("name", ["pp2dp2-s1-fp32-ws4", "tp2-s3-bf16-ws2", "tp2pp2-s1-bf16-ws4"])
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
    victim["hash"]["digest"] = "0" * 64  # only the sidecar's hashes can say this
    sidecar.write_text(json.dumps(doc))
    result = invoke("validate", str(copy_dir), "--format", "json")
    codes = {(f["code"], f.get("file")) for f in json.loads(result.stdout)["findings"]}
    assert result.exit_code == 1 and ("CK209", victim["path"]) in codes, result.stdout
    sidecar.unlink()  # generated from the files instead: no recorded hash to disagree with
    assert invoke("validate", str(copy_dir)).exit_code == 0


@pytest.mark.parametrize("name", HOOKED)
def test_the_hooked_checkpoint_reconstructs_to_the_live_masters(ds, name, tmp_path):
    """Bit for bit: every rank's gathered master of the hooked job, and the reconstruction of the
    checkpoint DeepSpeed saved itself in the first run of the job (deterministic training)."""
    from safetensors.torch import load_file

    entry, original = ds.path(hook_name(name)), ds.path(name)
    wholes = []
    for source in (entry, original):
        out = tmp_path / source.name
        result = invoke("reconstruct", str(source), str(out), "--quiet")
        assert result.exit_code == 0, result.stderr
        wholes.append(load_file(out / "model.safetensors"))
    hooked, native = wholes
    # every rank's live master (frozen parameters and buffers have none: they equal the native run's below)
    assert check_masters(entry, hooked) == sum(len(o["masters"]) for o in rank_oracles(entry)) > 0
    assert list(hooked) == list(native) and all(bits_equal(hooked[n], native[n]) for n in hooked)
