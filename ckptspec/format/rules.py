"""Semantic rules: what the JSON Schema cannot say about a manifest.

One rule = one function = one stable code. Each rule yields every finding it
sees (not just the first) and assumes the document already passed the schema.
``docs/errors.md`` documents each code; ``tests/conformance`` has a fixture for each.

Rules read the plain JSON document (dicts and lists, as decoded), not the Pydantic
models: that is what another implementation sees, and it lets ``ckptspec validate``
check a million-parameter manifest without building a million model objects.
Integers must be ``int`` (the loader turns an integral ``3.0`` into ``3``), and JSON
paths are only rendered for findings, never for every parameter.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from itertools import islice
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..findings import Finding, RuleSet, finding, json_path
from .dtypes import ITEMSIZE

if TYPE_CHECKING:
    from .models import Manifest

Document = dict[str, Any]
RuleFn = Callable[[Document], Iterator[Finding]]

# DeepSpeed pads each stage 1/2 flat group to nccl_start_alignment_factor (2) x world size.
NCCL_START_ALIGNMENT_FACTOR = 2


RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


def check_document(doc: Document) -> list[Finding]:
    """Run every semantic rule on a schema-valid document; findings in rule order."""
    return [found for r in RULES for found in r.check(doc)]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _flat_end(params: list[dict]) -> int:
    if not params:
        return 0
    last = params[-1]
    return last["offset"] + last["numel"] + last["padding"]


def _params(doc: Document) -> Iterator[tuple[int, int, dict]]:
    for g, grp in enumerate(doc["groups"]):
        for p, t in enumerate(grp["params"]):
            yield g, p, t


# --------------------------------------------------------------------------- tensors


@rule("CK101")
def numel_matches_shape(doc: Document) -> Iterator[Finding]:
    """numel == product(shape); [] is a 0-d tensor (numel 1), a 0 in the shape gives 0."""
    prod = math.prod
    sections = [(("groups", g, "params"), grp["params"]) for g, grp in enumerate(doc["groups"])]
    sections.append((("frozen",), doc["frozen"]))
    for where, tensors in sections:
        for i, t in enumerate(tensors):
            expected = prod(t["shape"])
            if t["numel"] != expected:
                yield finding(
                    "CK101",
                    json_path(*where, i, "numel"),
                    f"{t['name']}: numel {t['numel']} but shape {t['shape']} holds {expected} elements",
                    "numel must be the product of the shape ([] is a scalar: 1)",
                )


_NAMED_SECTIONS = ("frozen", "buffers", "aliases", "excluded")


def _name_entries(doc: Document) -> Iterator[tuple[tuple, str]]:
    """(JSON path parts, name) of every declared state-dict key, in document order."""
    for g, p, t in _params(doc):
        yield ("groups", g, "params", p), t["name"]
    for section in _NAMED_SECTIONS:
        for i, t in enumerate(doc[section]):
            yield (section, i), t["name"]


@rule("CK102")
def names_are_unique(doc: Document) -> Iterator[Finding]:
    """A state-dict key has exactly one role: trainable, frozen, buffer, alias or excluded."""
    names = [t["name"] for grp in doc["groups"] for t in grp["params"]]
    names += [t["name"] for section in _NAMED_SECTIONS for t in doc[section]]
    if len(set(names)) == len(names):
        return  # the common case: no paths to render
    seen: dict[str, str] = {}
    for where, name in _name_entries(doc):
        path = json_path(*where, "name")
        if name in seen:
            yield finding(
                "CK102",
                path,
                f"{name!r} is already declared at {seen[name]}",
                "each name may appear once across params, frozen, buffers, aliases and excluded",
            )
        else:
            seen[name] = path


# --------------------------------------------------------------------------- aliases


def _owner_shapes(doc: Document) -> dict[str, list[int]]:
    """Shapes of the declared tensors (params, frozen, buffers) that aliases point at."""
    wanted = {a["owner"] for a in doc["aliases"]}
    tensors = [t for grp in doc["groups"] for t in grp["params"]] + doc["frozen"] + doc["buffers"]
    return {t["name"]: t["shape"] for t in tensors if t["name"] in wanted}


@rule("CK103")
def alias_owner_exists(doc: Document) -> Iterator[Finding]:
    if not doc["aliases"]:
        return
    owners = _owner_shapes(doc).keys() | {a["name"] for a in doc["aliases"]}
    for i, alias in enumerate(doc["aliases"]):
        if alias["owner"] not in owners:
            yield finding(
                "CK103",
                json_path("aliases", i, "owner"),
                f"alias {alias['name']!r} points to {alias['owner']!r}, which is not declared",
                "the owner must be a trainable or frozen parameter (or buffer) of this manifest",
            )


@rule("CK104")
def alias_owner_is_not_alias(doc: Document) -> Iterator[Finding]:
    """Aliases point straight at an owner: no chains, no cycles, no self-alias."""
    alias_names = {a["name"] for a in doc["aliases"]}
    for i, alias in enumerate(doc["aliases"]):
        if alias["owner"] in alias_names or alias["owner"] == alias["name"]:
            yield finding(
                "CK104",
                json_path("aliases", i, "owner"),
                f"alias {alias['name']!r} points to {alias['owner']!r}, which is itself an alias",
                "point every alias directly at the tensor that owns the storage",
            )


@rule("CK105")
def alias_shape_matches_owner(doc: Document) -> Iterator[Finding]:
    """Catches zero-element params 'tied' through a shared data_ptr() of 0."""
    if not doc["aliases"]:
        return
    shapes = _owner_shapes(doc)
    for i, alias in enumerate(doc["aliases"]):
        owner_shape = shapes.get(alias["owner"])
        if owner_shape is not None and owner_shape != alias["shape"]:
            yield finding(
                "CK105",
                json_path("aliases", i, "shape"),
                f"alias {alias['name']!r} has shape {alias['shape']} but its owner {alias['owner']!r} has {owner_shape}",
                "a tied tensor has its owner's shape; a mismatch means the tie was inferred wrongly",
            )


# --------------------------------------------------------------------------- layout of groups


@rule("CK111")
def partitioning_matches_stage(doc: Document) -> Iterator[Finding]:
    """Stage 3 partitions each param; stages 0-2 split one flat buffer; stage 0 does not split."""
    stage = doc["layout"]["zero_stage"]
    expected = "per_param" if stage == 3 else "flat"
    for g, grp in enumerate(doc["groups"]):
        if grp["partitioning"] != expected:
            yield finding(
                "CK111",
                json_path("groups", g, "partitioning"),
                f"ZeRO stage {stage} uses {expected!r} partitioning, not {grp['partitioning']!r}",
                "stage 3 is per_param; stages 0, 1 and 2 are flat",
            )
        if stage == 0 and grp["partition_count"] != 1:
            yield finding(
                "CK111",
                json_path("groups", g, "partition_count"),
                f"ZeRO stage 0 does not partition, but partition_count is {grp['partition_count']}",
                "use partition_count 1 at stage 0",
            )


@rule("CK112")
def partition_count_matches_world(doc: Document) -> Iterator[Finding]:
    layout = doc["layout"]
    for g, grp in enumerate(doc["groups"]):
        # Stage 0 does not partition (CK111 checks partition_count 1 there).
        if layout["zero_stage"] != 0 and grp["partition_count"] != layout["world_size"]:
            yield finding(
                "CK112",
                json_path("groups", g, "partition_count"),
                f"group is split over {grp['partition_count']} ranks but world_size is {layout['world_size']}",
                "a data-parallel group is partitioned over every rank",
            )
        if len(grp["saved_numels"]) != grp["partition_count"]:
            yield finding(
                "CK112",
                json_path("groups", g, "saved_numels"),
                f"{len(grp['saved_numels'])} saved_numels for {grp['partition_count']} partitions",
                "give one saved numel per rank",
            )


@rule("CK110")
def group_alignment(doc: Document) -> Iterator[Finding]:
    stage = doc["layout"]["zero_stage"]
    for g, grp in enumerate(doc["groups"]):
        if grp["partitioning"] == "flat":
            expected = NCCL_START_ALIGNMENT_FACTOR * grp["partition_count"] if stage in (1, 2) else 1
        else:
            expected = 1
        if grp["alignment"] != expected:
            yield finding(
                "CK110",
                json_path("groups", g, "alignment"),
                f"alignment is {grp['alignment']}, expected {expected}",
                "stage 1/2 flat groups align to 2 x partition_count; other groups use 1",
            )


@rule("CK109")
def param_padding(doc: Document) -> Iterator[Finding]:
    """Per-param padding: the ceil rule at stage 3; only with parameter_alignment at stage 1/2."""
    aligned = doc["layout"]["parameter_alignment"]
    for g, grp in enumerate(doc["groups"]):
        count = grp["partition_count"]
        per_param = grp["partitioning"] == "per_param"
        for p, t in enumerate(grp["params"]):
            if per_param:
                expected = (-t["numel"]) % count
                if t["padding"] != expected:
                    yield finding(
                        "CK109",
                        json_path("groups", g, "params", p, "padding"),
                        f"{t['name']}: padding {t['padding']}, but {t['numel']} elements over {count} ranks need {expected}",
                        "per_param padding is ceil(numel / partition_count) * partition_count - numel",
                    )
            elif t["padding"] and not aligned:
                yield finding(
                    "CK109",
                    json_path("groups", g, "params", p, "padding"),
                    f"{t['name']}: padding {t['padding']} without layout.parameter_alignment",
                    "set layout.parameter_alignment, or record padding 0",
                )


@rule("CK106")
def group_offsets(doc: Document) -> Iterator[Finding]:
    """Params are laid out back to back in the declared order, with their paddings."""
    for g, grp in enumerate(doc["groups"]):
        divisor = grp["partition_count"] if grp["partitioning"] == "per_param" else 1
        expected = 0
        for p, t in enumerate(grp["params"]):
            offset = t["offset"]
            if offset != expected:
                yield finding(
                    "CK106",
                    json_path("groups", g, "params", p, "offset"),
                    f"{t['name']}: offset {offset}, expected {expected} after the previous param and its padding",
                    "offsets follow the declared order: previous offset + numel + padding (per_param: divided by partition_count)",
                )
            expected = offset + (t["numel"] + t["padding"]) // divisor


@rule("CK107")
def group_total(doc: Document) -> Iterator[Finding]:
    """padded_numel = partition_numel x partition_count = the params' end rounded up to alignment."""
    for g, grp in enumerate(doc["groups"]):
        count, padded, partition = grp["partition_count"], grp["padded_numel"], grp["partition_numel"]
        if grp["partitioning"] == "per_param":
            expected_partition = sum((t["numel"] + t["padding"]) // count for t in grp["params"])
            if partition != expected_partition:
                yield finding(
                    "CK107",
                    json_path("groups", g, "partition_numel"),
                    f"partition_numel {partition}, but the params' partitions add up to {expected_partition}",
                    "per_param: partition_numel is the sum of ceil(numel / partition_count)",
                )
        else:
            end = _flat_end(grp["params"])
            expected_padded = round_up(end, grp["alignment"])
            if padded != expected_padded:
                yield finding(
                    "CK107",
                    json_path("groups", g, "padded_numel"),
                    f"padded_numel {padded}, but the params end at {end}, which aligns to {expected_padded}",
                    "padded_numel is the end of the last param rounded up to the group alignment",
                )
        if partition * count != padded:
            yield finding(
                "CK107",
                json_path("groups", g),
                f"partition_numel {partition} x partition_count {count} != padded_numel {padded}",
                "every rank holds an equal share of the padded group",
            )


@rule("CK108")
def saved_numels(doc: Document) -> Iterator[Finding]:
    """What each rank saved: the full partition, or (flat, stripped) its real part only."""
    tail_saved = doc["layout"]["tail_padding_saved"]
    for g, grp in enumerate(doc["groups"]):
        if len(grp["saved_numels"]) != grp["partition_count"]:
            continue  # CK112 reports it
        flat = grp["partitioning"] == "flat"
        end = _flat_end(grp["params"]) if flat else grp["padded_numel"]
        full = grp["partition_numel"]
        for r, saved in enumerate(grp["saved_numels"]):
            expected = full if not flat or tail_saved else min(full, max(0, end - r * full))
            if saved != expected:
                yield finding(
                    "CK108",
                    json_path("groups", g, "saved_numels", r),
                    f"rank {r} saved {saved} elements, expected {expected}",
                    "stage 1/2 strip the tail padding from the last rank(s) unless layout.tail_padding_saved; stage 3 ranks save equal partitions",
                    rank=r,
                )


# --------------------------------------------------------------------------- files and locators

_DRIVE = re.compile(r"^[A-Za-z]:")


@rule("CK113")
def paths_stay_inside(doc: Document) -> Iterator[Finding]:
    for i, f in enumerate(doc["files"]):
        path = f["path"]
        parts = path.replace("\\", "/").split("/")
        bad = (
            path.startswith(("/", "\\"))
            or _DRIVE.match(path)
            or ".." in parts
            or "" in parts
            or "." in parts
            or "\x00" in path
        )
        if bad:
            yield finding(
                "CK113",
                json_path("files", i, "path"),
                f"path {path!r} is not a plain relative path inside the checkpoint",
                "use forward-slash paths relative to the checkpoint directory, without '..', '.', empty parts or a drive",
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
        for k, loc in enumerate(f["partitions"]):
            path = json_path("files", i, "partitions", k)
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


@rule("CK118")
def locator_fits_member(doc: Document) -> Iterator[Finding]:
    for i, f in enumerate(doc["files"]):
        for k, loc in enumerate(f["partitions"]):
            start, stop = loc["element_offset"], loc["element_offset"] + loc["numel"]
            end = stop * ITEMSIZE[loc["dtype"]]
            if end > loc["member_size"]:
                yield finding(
                    "CK118",
                    json_path("files", i, "partitions", k),
                    f"elements [{start}, {stop}) of {loc['dtype']} end at byte {end}, past the {loc['member_size']}-byte member {loc['member']!r}",
                    "element_offset + numel must fit in the member",
                    file=f["path"],
                    rank=loc["rank"],
                )


@rule("CK119")
def locator_fits_file(doc: Document) -> Iterator[Finding]:
    for i, f in enumerate(doc["files"]):
        for k, loc in enumerate(f["partitions"]):
            end = loc["data_offset"] + loc["member_size"]
            if end > f["size"]:
                yield finding(
                    "CK119",
                    json_path("files", i, "partitions", k),
                    f"member {loc['member']!r} at bytes [{loc['data_offset']}, {end}) ends past the {f['size']}-byte file",
                    "data_offset + member_size must fit in the file's size",
                    file=f["path"],
                    rank=loc["rank"],
                )
