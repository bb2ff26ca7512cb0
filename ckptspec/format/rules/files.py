"""CK113-CK119: the file list: safe, unique paths, ranks in range, locators that cover and fit.

CK115, CK118 and CK119 apply to every kind of locator a file entry carries: the master
``partitions`` and (format 1.1) ``tensors``, ``model_weights`` and ``state_partitions``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import islice

from ...findings import Finding, RuleSet, finding, json_path
from ..dtypes import ITEMSIZE
from ..paths import stays_inside
from .document import LOCATOR_KEYS, Document, RuleFn, located

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


@rule("CK113")
def paths_stay_inside(doc: Document) -> Iterator[Finding]:
    for i, f in enumerate(doc["files"]):
        path = f["path"]
        if not stays_inside(path):
            yield finding(
                "CK113",
                json_path("files", i, "path"),
                f"path {path!r} is not a plain relative path inside the checkpoint",
                "use forward-slash paths relative to the checkpoint directory, without '..', '.', empty parts or a "
                "drive",
            )


@rule("CK114")
def paths_unique(doc: Document) -> Iterator[Finding]:
    seen: dict[str, int] = {}
    for i, f in enumerate(doc["files"]):
        if f["path"] in seen:
            yield finding(
                "CK114",
                json_path("files", i, "path"),
                f"{f['path']!r} is already listed at $.files[{seen[f['path']]}]",
                "list each file once",
            )
        seen.setdefault(f["path"], i)


@rule("CK115")
def ranks_in_range(doc: Document) -> Iterator[Finding]:
    world, groups = doc["layout"]["world_size"], doc["groups"]
    for i, f in enumerate(doc["files"]):
        for j, rank in enumerate(f["ranks"]):
            if rank >= world:
                yield finding(
                    "CK115",
                    json_path("files", i, "ranks", j),
                    f"rank {rank} is outside world_size {world}",
                    "ranks count from 0 to world_size - 1",
                    file=f["path"],
                    rank=rank,
                )
        for key in ("partitions", "state_partitions"):
            for k, loc in enumerate(f.get(key, ())):
                yield from _group_and_rank(groups, f, json_path("files", i, key, k), loc)
    for i, k, f, loc in located(doc, "model_weights"):
        if loc["group"] >= len(groups):
            yield finding(
                "CK115",
                json_path("files", i, "model_weights", k, "group"),
                f"group {loc['group']} does not exist ({len(groups)} groups)",
                "group is an index into $.groups",
                file=f["path"],
            )


def _group_and_rank(groups: list, f: dict, path: str, loc: dict) -> Iterator[Finding]:
    """A (group, rank) locator names an existing group, one of its ranks, and a rank of its file."""
    group, rank = loc["group"], loc["rank"]
    if group >= len(groups):
        yield finding(
            "CK115",
            path + ".group",
            f"group {group} does not exist ({len(groups)} groups)",
            "group is an index into $.groups",
            file=f["path"],
        )
    elif rank >= groups[group]["partition_count"]:
        yield finding(
            "CK115",
            path + ".rank",
            f"rank {rank} is outside group {group}'s {groups[group]['partition_count']} partitions",
            "rank counts from 0 to partition_count - 1",
            file=f["path"],
            rank=rank,
        )
    elif rank not in f["ranks"]:
        yield finding(
            "CK115",
            path + ".rank",
            f"locator for rank {rank} in a file of ranks {f['ranks']}",
            "a file holds partitions of its own ranks only",
            file=f["path"],
            rank=rank,
        )


def _valid_locators(doc: Document) -> Iterator[tuple[int, int, dict, dict]]:
    groups = doc["groups"]
    for i, f in enumerate(doc["files"]):
        for k, loc in enumerate(f["partitions"]):
            if loc["group"] < len(groups) and loc["rank"] < groups[loc["group"]]["partition_count"]:
                yield i, k, f, loc


@rule("CK116")
def locators_cover_every_partition(doc: Document) -> Iterator[Finding]:
    """If any partition is located, every (group, rank) partition is located exactly once."""
    located: dict[tuple[int, int], str] = {}
    any_locator = False
    for i, k, f, loc in _valid_locators(doc):
        any_locator = True
        key = (loc["group"], loc["rank"])
        path = json_path("files", i, "partitions", k)
        if key in located:
            yield finding(
                "CK116",
                path,
                f"group {loc['group']} rank {loc['rank']} is already located at {located[key]}",
                "locate each partition once",
                file=f["path"],
                rank=loc["rank"],
            )
        located.setdefault(key, path)
    if not any_locator:
        return
    per_group = Counter(g for g, _ in located)
    for g, grp in enumerate(doc["groups"]):
        count = grp["partition_count"]
        located_here = per_group[g]
        if located_here == count:
            continue
        # One finding per group: a bogus partition_count must not yield millions of them.
        missing = list(islice((r for r in range(count) if (g, r) not in located), 5))
        more = count - located_here - len(missing)
        ranks = ", ".join(map(str, missing)) + (f" and {more} more" if more > 0 else "")
        yield finding(
            "CK116",
            json_path("groups", g),
            f"no locator for group {g} rank(s) {ranks}",
            "every rank's partition of every group needs a locator in $.files[*].partitions",
            rank=missing[0],
        )


@rule("CK117")
def locator_matches_group(doc: Document) -> Iterator[Finding]:
    master_dtype = doc["layout"]["master_dtype"]
    for i, k, f, loc in _valid_locators(doc):
        grp = doc["groups"][loc["group"]]
        path = json_path("files", i, "partitions", k)
        rank, saved = loc["rank"], grp["saved_numels"]
        if rank < len(saved) and loc["numel"] != saved[rank]:
            yield finding(
                "CK117",
                path + ".numel",
                f"locator holds {loc['numel']} elements but group {loc['group']} rank {rank} saved {saved[rank]}",
                "a locator's numel is the group's saved numel for that rank",
                file=f["path"],
                rank=rank,
            )
        if loc["dtype"] != master_dtype:
            yield finding(
                "CK117",
                path + ".dtype",
                f"locator dtype {loc['dtype']} but master_dtype is {master_dtype}",
                "flat partitions hold master weights",
                file=f["path"],
                rank=rank,
            )


def _every_locator(doc: Document) -> Iterator[tuple[str, dict, dict, int | None]]:
    """(JSON path, file, locator, rank) of every locator of every kind."""
    for key in LOCATOR_KEYS:
        for i, k, f, loc in located(doc, key):
            rank = loc.get("rank", f["ranks"][0] if len(f["ranks"]) == 1 else None)
            yield json_path("files", i, key, k), f, loc, rank


@rule("CK118")
def locator_fits_member(doc: Document) -> Iterator[Finding]:
    for path, f, loc, rank in _every_locator(doc):
        start, stop = loc["element_offset"], loc["element_offset"] + loc["numel"]
        end = stop * ITEMSIZE[loc["dtype"]]
        if end > loc["member_size"]:
            yield finding(
                "CK118",
                path,
                f"elements [{start}, {stop}) of {loc['dtype']} end at byte {end}, past the "
                f"{loc['member_size']}-byte member {loc['member']!r}",
                "element_offset + numel must fit in the member",
                file=f["path"],
                rank=rank,
            )


@rule("CK119")
def locator_fits_file(doc: Document) -> Iterator[Finding]:
    for path, f, loc, rank in _every_locator(doc):
        end = loc["data_offset"] + loc["member_size"]
        if end > f["size"]:
            yield finding(
                "CK119",
                path,
                f"member {loc['member']!r} at bytes [{loc['data_offset']}, {end}) ends past the {f['size']}-byte file",
                "data_offset + member_size must fit in the file's size",
                file=f["path"],
                rank=rank,
            )
