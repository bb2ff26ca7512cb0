"""CK6xx: the rules of a checkpoint index that its JSON Schema cannot say (no files read).

One rule = one function = one code, as in ``rules/``. The rules read the plain decoded document
and assume it passed the schema and that every domain's manifest passed its own validation (a
domain's 1.x findings are reported first, under ``$.domains[i].manifest``). ``docs/errors.md``
documents each code; ``tests/unit/format/test_index.py`` has a fixture for each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from ..findings import Finding, RuleSet, finding, json_path

IndexRule = Callable[[dict[str, Any]], Iterator[Finding]]
INDEX_RULES: RuleSet[IndexRule] = RuleSet()
rule = INDEX_RULES.register

DENSE_GROUP = "data_parallel"  # the process group of a tensor/pipeline coordinate's ZeRO partitions
AXES = ("pipeline", "tensor", "data", "expert")


def _local_params(manifest: dict) -> dict[str, list[int]]:
    """Every trainable parameter of a domain manifest, by local name -> its local shape."""
    return {p["name"]: p["shape"] for g in manifest["groups"] for p in g["params"]}


@rule("CK602")
def topology(doc: dict) -> Iterator[Finding]:
    """The degrees agree with each other, the rank grid and every domain's coordinate."""
    topo = doc["topology"]
    deg = topo["degrees"]
    if deg["pipeline"] * deg["tensor"] != topo["model_parallel_size"]:
        yield finding(
            "CK602",
            json_path("topology", "model_parallel_size"),
            f"model_parallel_size {topo['model_parallel_size']} is not pipeline {deg['pipeline']} x tensor "
            f"{deg['tensor']}",
            "DeepSpeed's mp_world_size is the product of the pipeline and tensor degrees",
        )
    ranks = topo.get("ranks")
    if ranks is not None:
        world = math.prod(deg[a] for a in ("pipeline", "tensor", "data"))
        seen = {tuple(r[a] for a in ("pipeline", "tensor", "data")) for r in ranks}
        if len(ranks) != world or len(seen) != world or len({r["rank"] for r in ranks}) != world:
            yield finding(
                "CK602",
                json_path("topology", "ranks"),
                f"{len(ranks)} ranks with {len(seen)} distinct coordinates; the degrees give {world}",
                "list every rank of the launch once, with its own (pipeline, tensor, data) coordinate",
            )
        for i, r in enumerate(ranks):
            for axis in ("pipeline", "tensor", "data"):
                if r[axis] >= deg[axis]:
                    yield finding(
                        "CK602",
                        json_path("topology", "ranks", i, axis),
                        f"{axis} coordinate {r[axis]} is outside degree {deg[axis]}",
                        "coordinates count from 0 below their degree",
                    )
    dense: dict[tuple, int] = {}
    for i, dom in enumerate(doc["domains"]):
        coord = dom["coordinate"]
        for axis, value in coord.items():
            if axis in deg and value >= deg[axis]:
                yield finding(
                    "CK602",
                    json_path("domains", i, "coordinate", axis),
                    f"{axis} coordinate {value} is outside degree {deg[axis]}",
                    "coordinates count from 0 below their degree",
                )
        if dom["process_group"] == DENSE_GROUP:
            key = (coord.get("pipeline", 0), coord.get("tensor", 0))
            if key in dense:
                yield finding(
                    "CK602",
                    json_path("domains", i, "coordinate"),
                    f"a second data-parallel domain at pipeline {key[0]}, tensor {key[1]} "
                    f"(the first is domains[{dense[key]}])",
                    "each (pipeline, tensor) coordinate has one data-parallel domain",
                )
            dense.setdefault(key, i)
    for p in range(deg["pipeline"]):
        for t in range(deg["tensor"]):
            if (p, t) not in dense and doc.get("kind") != "universal":  # a universal folder has no ZeRO group
                yield finding(
                    "CK602",
                    json_path("domains"),
                    f"no data-parallel domain for pipeline {p}, tensor {t}",
                    "every model-parallel rank of the topology has its domain (its files)",
                )


@rule("CK603")
def domain_size(doc: dict) -> Iterator[Finding]:
    """A domain's size is its manifest's world size; its files' domain ranks are the manifest's ranks."""
    ids: dict[str, int] = {}
    for i, dom in enumerate(doc["domains"]):
        if dom["id"] in ids:
            yield finding(
                "CK603",
                json_path("domains", i, "id"),
                f"domain id {dom['id']!r} is also domains[{ids[dom['id']]}]'s",
                "domain ids are unique: shards name their domain by id",
            )
        ids.setdefault(dom["id"], i)
        layout = dom["manifest"]["layout"]
        if dom["size"] != layout["world_size"]:
            yield finding(
                "CK603",
                json_path("domains", i, "size"),
                f"size {dom['size']} but the domain's manifest has world_size {layout['world_size']}",
                "a domain's manifest describes the partitions over the domain's own process group",
            )
        members = dom.get("members")
        if members is not None and len(members) != dom["size"]:
            yield finding(
                "CK603",
                json_path("domains", i, "members"),
                f"{len(members)} members for a domain of size {dom['size']}",
                "members lists the global rank of each domain rank",
            )
        files = {f["path"]: f for f in dom["manifest"]["files"] if f["role"] in ("model_states", "optimizer_states")}
        for path, rank in dom["file_ranks"].items():
            entry = files.get(path)
            if rank >= dom["size"] or entry is None or rank not in entry["ranks"]:
                yield finding(
                    "CK603",
                    json_path("domains", i, "file_ranks", path),
                    f"file_ranks gives {path} domain rank {rank}; the domain's manifest "
                    + ("does not list it" if entry is None else f"gives ranks {entry['ranks']}"),
                    "file_ranks and the manifest's files[].ranks say the same thing",
                )
        for path in files.keys() - dom["file_ranks"].keys():
            yield finding(
                "CK603",
                json_path("domains", i, "file_ranks"),
                f"{path} is in the domain's manifest but not in file_ranks",
                "every model- and optimizer-states file of a domain has its domain rank in file_ranks",
            )


@rule("CK604")
def shared_files(doc: dict) -> Iterator[Finding]:
    """A file listed by several domains is listed with the same size and hash by each."""
    first: dict[str, tuple[int, dict]] = {}
    for i, dom in enumerate(doc["domains"]):
        for j, f in enumerate(dom["manifest"]["files"]):
            if f["path"] not in first:
                first[f["path"]] = (i, f)
                continue
            k, other = first[f["path"]]
            if (f["size"], f.get("hash")) != (other["size"], other.get("hash")):
                yield finding(
                    "CK604",
                    json_path("domains", i, "manifest", "files", j),
                    f"{f['path']} is listed by domains[{k}] too, with another size or hash",
                    "one file has one size and one hash",
                )


def _tiles(blocks: list[tuple[int, int]], length: int) -> bool:
    pos = 0
    for offset, size in sorted(blocks):
        if offset != pos:
            return False
        pos += size
    return pos == length


def _piece_count(pieces: list[dict]) -> int:
    return sum(math.prod(p["shape"]) for p in pieces)


@rule("CK605")
def shards_compose(doc: dict) -> Iterator[Finding]:
    """Every whole-model parameter's (and, 1.1, frozen parameter's and buffer's) shards compose its shape exactly."""
    whole = [("parameters", i, p) for i, p in enumerate(doc["parameters"])]
    for key, i, param in whole + [("extras", i, e) for i, e in enumerate(doc.get("extras") or [])]:
        shape, shards = param["shape"], param["shards"]
        at = json_path(key, i, "shards")
        kinds = {s["placement"] if isinstance(s["placement"], str) else next(iter(s["placement"])) for s in shards}
        if len(kinds) != 1:
            yield finding(
                "CK605", at, f"{param['name']}: shards mix placements {sorted(kinds)}", "one placement per parameter"
            )
            continue
        kind = kinds.pop()
        if kind in ("replicated", "whole"):
            bad = [j for j, s in enumerate(shards) if s["local_shape"] != shape]
            primaries = [j for j, s in enumerate(shards) if s.get("primary", len(shards) == 1)]
            if bad:
                yield finding(
                    "CK605",
                    json_path(key, i, "shards", bad[0], "local_shape"),
                    f"{param['name']}: a {kind} shard of shape {shards[bad[0]]['local_shape']}, not {shape}",
                    f"a {kind} shard is the whole tensor",
                )
            if len(primaries) != 1 or (kind == "whole" and len(shards) != 1):
                yield finding(
                    "CK605",
                    at,
                    f"{param['name']}: {len(shards)} {kind} shards, {len(primaries)} primary",
                    "a whole parameter has one shard; replicated ones have exactly one primary",
                )
        elif kind == "split":
            axes = {s["placement"]["split"]["axis"] for s in shards}
            axis = axes.pop() if len(axes) == 1 else None
            if axis is None or axis >= len(shape):
                # shards split along several axes: name them (sorting them with None raised a TypeError: CK999)
                named = sorted(axes) if axis is None else [axis]
                yield finding("CK605", at, f"{param['name']}: split along axes {named}", _SPLIT_HINT)
                continue
            blocks = [(s["placement"]["split"]["offset"], s["placement"]["split"]["length"]) for s in shards]
            wrong = [
                j
                for j, s in enumerate(shards)
                if s["local_shape"] != [*shape[:axis], s["placement"]["split"]["length"], *shape[axis + 1 :]]
            ]
            if wrong or not _tiles(blocks, shape[axis]):
                yield finding(
                    "CK605",
                    at,
                    f"{param['name']}: shards {[s['local_shape'] for s in shards]} at {sorted(blocks)} along axis "
                    f"{axis} do not tile shape {shape}",
                    _SPLIT_HINT,
                )
        else:
            total = sum(_piece_count(s["placement"]["pieces"]) for s in shards)
            if total != math.prod(shape):
                yield finding(
                    "CK605",
                    at,
                    f"{param['name']}: pieces hold {total} elements, the shape {shape} {math.prod(shape)}",
                    "affine pieces cover every element of the whole tensor once",
                )


_SPLIT_HINT = "split shards are blocks along one axis that tile it without gap or overlap"


@rule("CK606")
def shards_claimed(doc: dict) -> Iterator[Finding]:
    """Each trainable parameter of each domain is a shard of exactly one whole-model parameter."""
    domains = {d["id"]: (i, _local_params(d["manifest"])) for i, d in enumerate(doc["domains"])}
    claimed: dict[tuple[str, str], int] = {}
    for i, param in enumerate(doc["parameters"]):
        for j, shard in enumerate(param["shards"]):
            at = json_path("parameters", i, "shards", j)
            if shard["domain"] not in domains:
                yield finding("CK606", at, f"no domain {shard['domain']!r}", "a shard names a domain of the index")
                continue
            _, local = domains[shard["domain"]]
            key = (shard["domain"], shard["local_name"])
            if key[1] not in local or local[key[1]] != shard["local_shape"]:
                what = "has no parameter" if key[1] not in local else f"has shape {local[key[1]]} for"
                yield finding(
                    "CK606",
                    at,
                    f"domain {key[0]!r} {what} {key[1]!r} "
                    f"(shard of {param['name']}, local shape {shard['local_shape']})",
                    "a shard is a trainable parameter of its domain's manifest, with the same shape",
                )
            elif key in claimed:
                yield finding(
                    "CK606",
                    at,
                    f"{key[1]!r} of domain {key[0]!r} is also a shard of parameters[{claimed[key]}]",
                    "each local parameter is a shard of one whole-model parameter",
                )
            claimed.setdefault(key, i)
    for dom_id, (i, local) in domains.items():
        for name in local:
            if (dom_id, name) not in claimed:
                yield finding(
                    "CK606",
                    json_path("domains", i, "manifest", "groups"),
                    f"{name!r} of domain {dom_id!r} is no shard of any whole-model parameter",
                    "list it as a shard in parameters[], or the merged model would lose it",
                )


@rule("CK607")
def layer_files(doc: dict) -> Iterator[Finding]:
    """Pipeline layer files: one per layer, at a stage of the topology, and naming that stage's shards."""
    deg = doc["topology"]["degrees"]
    seen: dict[tuple, int] = {}
    stage_of = {d["id"]: d["coordinate"].get("pipeline", 0) for d in doc["domains"]}
    keys = {
        (s["layer_file"], s.get("layer_key")): stage_of.get(s["domain"])
        for p in doc["parameters"]
        for s in p["shards"]
        if "layer_file" in s
    }
    for i, lf in enumerate(doc["layer_files"]):
        at = json_path("layer_files", i)
        key = (lf["layer"], lf.get("tensor"))
        if lf["pipeline"] >= deg["pipeline"]:
            yield finding("CK607", at, f"{lf['path']}: stage {lf['pipeline']} of {deg['pipeline']}", _LAYER_HINT)
        if key in seen:
            yield finding(
                "CK607", at, f"{lf['path']}: layer {lf['layer']} is also layer_files[{seen[key]}]", _LAYER_HINT
            )
        seen.setdefault(key, i)
        for local_key in lf["tensors"]:
            if keys.get((lf["path"], local_key), lf["pipeline"]) != lf["pipeline"]:
                yield finding(
                    "CK607",
                    json_path("layer_files", i, "tensors", local_key),
                    f"{lf['path']} (stage {lf['pipeline']}) holds {local_key!r}, a shard of another stage's domain",
                    _LAYER_HINT,
                )
    listed = {lf["path"] for lf in doc["layer_files"]}
    for lf_path in sorted({path for path, _ in keys} - listed):
        yield finding(
            "CK607",
            json_path("parameters"),
            f"a shard names layer file {lf_path}, which layer_files does not list",
            _LAYER_HINT + "; restore the file if it is missing",
            file=lf_path,
        )


_LAYER_HINT = "each pipeline layer has one layer file, written by the stage that owns the layer"


@rule("CK608")
def placement_source(doc: dict) -> Iterator[Finding]:
    """Where a merge rule came from is recorded, and it fits the placements."""
    tensor_pipeline = any(lf.get("tensor") is not None for lf in doc["layer_files"])
    for i, param in enumerate(doc["parameters"]):
        source = param["placement_source"]
        split = any(not isinstance(s["placement"], str) for s in param["shards"])
        if split and source not in ("affine_map", "universal_checkpoint_info", "engine"):
            yield finding(
                "CK608",
                json_path("parameters", i, "placement_source"),
                f"{param['name']}: split shards with placement_source {source!r}",
                "a tensor-parallel split is known from DeepSpeed's affine_map, universal_checkpoint_info or the "
                "live engine; an unknown rule is refused, never guessed",
            )
        layered = any("layer_file" in s for s in param["shards"])
        # a tensor-parallel pipeline's layer files hold shards whose merge rule is the recorded one, replicated too
        ruled = layered and tensor_pipeline and source in ("affine_map", "universal_checkpoint_info")
        if layered != (source == "pipeline_layer") and not split and not ruled:
            yield finding(
                "CK608",
                json_path("parameters", i, "placement_source"),
                f"{param['name']}: placement_source {source!r} " + ("with" if layered else "without") + " a layer file",
                "pipeline_layer is the source exactly when the shard lives in a pipeline layer file",
            )


@rule("CK609")
def master_dtype(doc: dict) -> Iterator[Finding]:
    """What a domain's ``masters`` and ``replicas`` locate is in its manifest's ``master_dtype``: the
    low-precision weights beside a checkpoint's masters are never masters."""
    for i, domain in enumerate(doc["domains"]):
        want = domain["manifest"]["layout"]["master_dtype"]
        located: list[tuple[Any, ...]] = [
            ("masters", "tensors", j, loc) for j, loc in enumerate((domain.get("masters") or {}).get("tensors", []))
        ]
        located += [("replicas", j, loc) for j, loc in enumerate(domain.get("replicas") or [])]
        wrong = [(at, loc) for *at, loc in located if loc["dtype"] != want]
        if wrong:  # one finding per domain, naming the first
            at, loc = wrong[0]
            more = f" ({len(wrong) - 1} more locators of this domain too)" if len(wrong) > 1 else ""
            yield finding(
                "CK609",
                json_path("domains", i, *at),
                f"the master of {loc['param']!r} is located in {loc['dtype']} data ({loc['file']}: "
                f"{'/'.join(map(str, loc['key']))}); the domain's master_dtype is {want}{more}",
                "these are not the fp32 masters (an earlier ckptspec took a stage-0 FP16_Optimizer checkpoint's "
                "bf16/fp16 weights for them): regenerate the index with `ckptspec generate CHECKPOINT`",
            )


def check_index_rules(doc: dict) -> list[Finding]:
    return [found for r in INDEX_RULES for found in r.check(doc)]
