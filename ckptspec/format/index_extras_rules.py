"""CK610: the frozen parameters, buffers and ties a checkpoint index 1.1 places (``extras``, ``aliases``).

One rule in the registry of ``index_rules.py`` (CK605 checks the extras' placements as the parameters'):
every shard is a tensor its domain holds, the domain manifest's frozen parameter or buffer of that name,
shape and dtype, or a layer file's key of the domain's stage, located inside its zip member; no name is
two tensors of the whole model; a tie's owner is a tensor of it. When ``extras`` is there, every frozen
parameter and buffer of a domain whose masters are ZeRO partitions is a shard of one extra (or the
merged model would lose it). ``validate_index_document`` loads this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ..findings import Finding, finding, json_path
from .dtypes import ITEMSIZE
from .index_rules import rule

_HINT = "regenerate the checkpoint index with `ckptspec generate CHECKPOINT`"


def _held(manifest: dict) -> dict[tuple[str, str], dict]:
    """(role, local name) -> the domain manifest's entry of each frozen parameter and buffer."""
    held = {("frozen", f["name"]): f for f in manifest["frozen"]}
    held.update({("buffer", b["name"]): b for b in manifest["buffers"]})
    return held


def _shard_problem(extra: dict, shard: dict, domain: dict | None, layer_files: dict[str, dict]) -> str | None:
    if domain is None:
        return f"no domain {shard['domain']!r}"
    locator = shard.get("locator")
    if locator is None:
        held = _held(domain["manifest"]).get((extra["role"], shard["local_name"]))
        if held is None:
            return f"domain {shard['domain']!r} has no {extra['role']} {shard['local_name']!r}"
        if held["shape"] != shard["local_shape"] or held["dtype"] != extra["dtype"]:
            return (
                f"domain {shard['domain']!r}'s {shard['local_name']!r} is {held['dtype']} {held['shape']}, "
                f"the shard {extra['dtype']} {shard['local_shape']}"
            )
        return None
    lf = layer_files.get(shard.get("layer_file", ""))
    if lf is None or lf["pipeline"] != domain["coordinate"].get("pipeline"):
        return f"a locator in {shard.get('layer_file')!r}, no layer file of the domain's stage"
    if lf["tensors"].get(shard.get("layer_key", "")) != shard["local_name"]:
        return f"{lf['path']} has no key {shard.get('layer_key')!r} for {shard['local_name']!r}"
    if locator["dtype"] != extra["dtype"] or locator["numel"] != math.prod(shard["local_shape"]):
        return f"the locator holds {locator['numel']} {locator['dtype']} elements, the shard is {extra['dtype']}"
    if (locator["element_offset"] + locator["numel"]) * ITEMSIZE[locator["dtype"]] > locator["member_size"]:
        return f"the locator's elements end past member {locator['member']!r} ({locator['member_size']} bytes)"
    return None


@rule("CK610")
def extras_placed(doc: dict) -> Iterator[Finding]:
    """Each extra's shards are tensors their domains hold; names and ties are of one whole model."""
    extras, aliases = doc.get("extras"), doc.get("aliases") or {}
    domains = {d["id"]: d for d in doc["domains"]}
    layer_files = {lf["path"]: lf for lf in doc["layer_files"]}
    names = {p["name"] for p in doc["parameters"]}
    claimed: set[tuple[str, str, str]] = set()
    for i, extra in enumerate(extras or []):
        if extra["name"] in names:
            yield finding("CK610", json_path("extras", i, "name"), f"{extra['name']!r} names two tensors", _HINT)
        names.add(extra["name"])
        for j, shard in enumerate(extra["shards"]):
            problem = _shard_problem(extra, shard, domains.get(shard["domain"]), layer_files)
            if problem:
                yield finding("CK610", json_path("extras", i, "shards", j), f"{extra['name']}: {problem}", _HINT)
            claimed.add((shard["domain"], extra["role"], shard["local_name"]))
    for alias, owner in aliases.items():
        if alias in names or owner not in names:
            yield finding(
                "CK610",
                json_path("aliases", alias),
                f"tie {alias!r} -> {owner!r}: " + ("a tensor's own name" if alias in names else "no such tensor"),
                "a tie names a whole-model parameter, frozen parameter or buffer as its owner, and is none itself",
            )
    if extras is None:
        return
    for i, domain in enumerate(doc["domains"]):
        if "masters" in domain:
            continue
        for role, name in _held(domain["manifest"]):
            if (domain["id"], role, name) not in claimed:
                yield finding(
                    "CK610",
                    json_path("domains", i, "manifest", "frozen" if role == "frozen" else "buffers"),
                    f"{role} {name!r} of domain {domain['id']!r} is no shard of any extra",
                    "list it as a shard in extras[], or the merged model would lose it",
                )
