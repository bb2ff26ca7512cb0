"""CK106-CK112: the partition arithmetic of every group: partitioning, counts, alignment,
paddings, offsets, totals and what each rank saved (the arithmetic of ``format.partition``,
checked from the other side)."""

from __future__ import annotations

from collections.abc import Iterator

from ...findings import Finding, RuleSet, finding, json_path
from ..partition import NCCL_START_ALIGNMENT_FACTOR, round_up
from .document import Document, RuleFn, flat_end

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


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
                        f"{t['name']}: padding {t['padding']}, but {t['numel']} elements over {count} ranks need "
                        f"{expected}",
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
                    "offsets follow the declared order: previous offset + numel + padding (per_param: divided by "
                    "partition_count)",
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
            end = flat_end(grp["params"])
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
        end = flat_end(grp["params"]) if flat else grp["padded_numel"]
        full = grp["partition_numel"]
        for r, saved in enumerate(grp["saved_numels"]):
            expected = full if not flat or tail_saved else min(full, max(0, end - r * full))
            if saved != expected:
                yield finding(
                    "CK108",
                    json_path("groups", g, "saved_numels", r),
                    f"rank {r} saved {saved} elements, expected {expected}",
                    "stage 1/2 strip the tail padding from the last rank(s) unless layout.tail_padding_saved; "
                    "stage 3 ranks save equal partitions",
                    rank=r,
                )
