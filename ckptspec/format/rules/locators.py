"""CK120-CK123 (format 1.1): the locators of frozen parameters, buffers and low-precision flat weights.

A file entry of a model-states file locates the tensors it holds by name (``tensors``: frozen
parameters, this rank's fragment of them at stage 3, buffers) and the flat low-precision
weights of each group (``model_weights``). These rules check what the document alone can tell:
that every located name is one the locator can hold, that a manifest locating any named tensor
locates each of them exactly where its ``stored_in`` says, and that every locator holds the
elements and dtype of what it locates. (Bounds: CK118/CK119; the files themselves: CK221.)
"""

from __future__ import annotations

from collections.abc import Iterator

from ...findings import Finding, RuleSet, finding, json_path
from .document import Document, RuleFn, located

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


def _targets(doc: Document) -> dict[str, tuple[str, int, dict]]:
    """Locatable names: frozen parameters and buffers -> (section, index, entry)."""
    out: dict[str, tuple[str, int, dict]] = {}
    for section in ("frozen", "buffers"):
        for i, t in enumerate(doc[section]):
            out.setdefault(t["name"], (section, i, t))
    return out


def _roles(doc: Document) -> dict[str, str]:
    roles = {t["name"]: "a trainable parameter" for g in doc["groups"] for t in g["params"]}
    roles.update({a["name"]: "an alias (located through its owner)" for a in doc["aliases"]})
    roles.update({e["name"]: "excluded from the checkpoint" for e in doc["excluded"]})
    return roles


def _file_rank(f: dict) -> int | None:
    return f["ranks"][0] if len(f["ranks"]) == 1 else None


def share(numel: int, world_size: int, rank: int) -> int:
    """The real elements of a stage-3 frozen fragment of ``rank``: ceil(numel / ws), less at the end."""
    part = -(-numel // world_size)
    return max(0, min(part, numel - rank * part))


# Which file role holds each kind of locator.
_HOLDERS = {"tensors": "model_states", "model_weights": "model_states", "state_partitions": "optimizer_states"}


@rule("CK120")
def locator_targets(doc: Document) -> Iterator[Finding]:
    """A named locator names a frozen parameter or buffer, in a model-states file; flat weights are in a
    model-states file, optimizer state partitions in an optimizer-states file."""
    targets, roles = _targets(doc), None
    for i, j, f, loc in located(doc, "tensors"):
        where = json_path("files", i, "tensors", j)
        if loc["name"] not in targets:
            roles = roles if roles is not None else _roles(doc)
            what = roles.get(loc["name"], "not declared in the manifest")
            yield finding(
                "CK120",
                where + ".name",
                f"locates {loc['name']!r}, which is {what}",
                "files[].tensors locate frozen parameters and buffers; trainable parameters are located through "
                "partitions, aliases through their owner",
                file=f["path"],
                rank=_file_rank(f),
            )
    for key, want in _HOLDERS.items():
        for i, f in enumerate(doc["files"]):
            if f.get(key) and f["role"] != want:
                yield finding(
                    "CK120",
                    json_path("files", i, key),
                    f"a {f['role']} file carries {key}",
                    f"{key} belong to {want} files, where DeepSpeed saves them",
                    file=f["path"],
                    rank=_file_rank(f),
                )


@rule("CK121")
def tensors_located_once(doc: Document) -> Iterator[Finding]:
    """If any file locates named tensors, each frozen parameter and buffer is located exactly as stored:
    once, or (stage 3 fragments) once in each rank's model-states file."""
    if not any("tensors" in f for f in doc["files"]):
        return
    world = doc["layout"]["world_size"]
    seen: dict[str, list[tuple[int | None, str]]] = {}
    for i, j, f, loc in located(doc, "tensors"):
        seen.setdefault(loc["name"], []).append((_file_rank(f), json_path("files", i, "tensors", j)))
    for section, i, t in _targets(doc).values():
        fragments = section == "frozen" and t["stored_in"] == "partitioned_fragments"
        found = seen.get(t["name"], [])
        where = json_path(section, i)
        if not fragments:
            if len(found) != 1:
                yield finding(
                    "CK121",
                    where,
                    f"{t['name']!r} is " + (f"located {len(found)} times" if found else "not located"),
                    "locate each frozen parameter and buffer once (stage 3 fragments: once per rank)",
                )
            continue
        ranks = [r for r, _ in found]
        wrong = sorted({r for r in ranks if r is None or r >= world or ranks.count(r) > 1}, key=str)
        missing = [r for r in range(world) if r not in ranks]
        if wrong or missing:
            detail = ", ".join(
                ([f"no fragment of rank(s) {', '.join(map(str, missing[:5]))}"] if missing else [])
                + ([f"stray or repeated fragments ({', '.join(map(str, wrong))})"] if wrong else [])
            )
            yield finding(
                "CK121",
                where,
                f"{t['name']!r} is stored in partitioned fragments: {detail}",
                "locate rank r's fragment once, in rank r's model-states file, for every rank",
                rank=missing[0] if missing else None,
            )


@rule("CK122")
def tensor_locator_numel(doc: Document) -> Iterator[Finding]:
    """A named locator holds the tensor's elements (a stage-3 fragment: that rank's real elements) in its dtype."""
    targets, world = _targets(doc), doc["layout"]["world_size"]
    for i, j, f, loc in located(doc, "tensors"):
        if loc["name"] not in targets:
            continue
        section, _, t = targets[loc["name"]]
        numel = t["numel"] if section == "frozen" else _product(t["shape"])
        rank = _file_rank(f)
        if section == "frozen" and t["stored_in"] == "partitioned_fragments":
            if rank is None or rank >= world:
                continue  # CK121 reports the file
            numel = share(numel, world, rank)
        where = json_path("files", i, "tensors", j)
        if loc["numel"] != numel:
            yield finding(
                "CK122",
                where + ".numel",
                f"{loc['name']}: the locator holds {loc['numel']} elements, the tensor has {numel} here",
                "numel counts the tensor's real elements (a stage-3 fragment: ceil(numel / world_size), less on "
                "the last rank(s)); padding is never located",
                file=f["path"],
                rank=rank,
            )
        if loc["dtype"] != t["dtype"]:
            yield finding(
                "CK122",
                where + ".dtype",
                f"{loc['name']}: the locator's dtype is {loc['dtype']}, the tensor's {t['dtype']}",
                "a locator has the dtype of the tensor it locates",
                file=f["path"],
                rank=rank,
            )


@rule("CK123")
def model_weights_locator(doc: Document) -> Iterator[Finding]:
    """A flat group's low-precision weights: once, padded_numel elements of layout.model_dtype."""
    groups, model_dtype = doc["groups"], doc["layout"]["model_dtype"]
    seen: dict[int, str] = {}
    for i, j, f, loc in located(doc, "model_weights"):
        g = loc["group"]
        if g >= len(groups):
            continue  # CK115
        where = json_path("files", i, "model_weights", j)
        grp = groups[g]
        if grp["partitioning"] != "flat":
            yield finding(
                "CK123",
                where + ".group",
                f"group {g} is per_param: stage 3 saves no flat low-precision weights",
                "locate model_weights of flat groups only",
                file=f["path"],
            )
            continue
        if g in seen:
            yield finding(
                "CK123",
                where,
                f"group {g}'s flat weights are already located at {seen[g]}",
                "locate each group's flat weights once",
                file=f["path"],
            )
        seen.setdefault(g, where)
        if loc["numel"] != grp["padded_numel"]:
            yield finding(
                "CK123",
                where + ".numel",
                f"the locator holds {loc['numel']} elements, group {g}'s flat buffer {grp['padded_numel']}",
                "the flat low-precision weights are the whole padded group (padded_numel); each param is at its offset",
                file=f["path"],
            )
        if loc["dtype"] != model_dtype:
            yield finding(
                "CK123",
                where + ".dtype",
                f"the locator's dtype is {loc['dtype']}, layout.model_dtype {model_dtype}",
                "the flat weights hold the model dtype",
                file=f["path"],
            )


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
