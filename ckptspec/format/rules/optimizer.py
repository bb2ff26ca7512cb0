"""CK124-CK126 (format 1.1): the optimizer state: its partitions and its param groups.

An optimizer-states file locates each per-element state (``exp_avg``, ``exp_avg_sq``, ...) of each
of its ranks' group partitions (``state_partitions``). A state partition has the element
positions of the group's master partition and its whole length, padding included, on every
rank: DeepSpeed keeps the tail the master partition drops. ``optimizer.groups`` describes the
torch optimizer's param groups (hyperparameters, step). (Group and rank ranges: CK115; bounds:
CK118/CK119; the files themselves: CK221.)
"""

from __future__ import annotations

from collections.abc import Iterator

from ...findings import Finding, RuleSet, finding, json_path
from .document import Document, RuleFn, located

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


def _in_range(doc: Document) -> Iterator[tuple[int, int, dict, dict]]:
    groups = doc["groups"]
    for i, j, f, loc in located(doc, "state_partitions"):
        if loc["group"] < len(groups) and loc["rank"] < groups[loc["group"]]["partition_count"]:
            yield i, j, f, loc


@rule("CK124")
def state_coverage(doc: Document) -> Iterator[Finding]:
    """Each (group, rank, state) is located once, and every rank of a group holds the same states."""
    seen: dict[tuple[int, int, str], str] = {}
    states: dict[int, set[str]] = {}
    for i, j, f, loc in _in_range(doc):
        key = (loc["group"], loc["rank"], loc["state"])
        where = json_path("files", i, "state_partitions", j)
        if key in seen:
            yield finding(
                "CK124",
                where,
                f"state {loc['state']!r} of group {loc['group']} rank {loc['rank']} is already located at {seen[key]}",
                "locate each state partition once",
                file=f["path"],
                rank=loc["rank"],
            )
        seen.setdefault(key, where)
        states.setdefault(loc["group"], set()).add(loc["state"])
    for g, names in sorted(states.items()):
        yield from _missing_states(g, names, doc["groups"][g]["partition_count"], seen)


def _missing_states(g: int, names: set[str], ranks: int, seen: dict) -> Iterator[Finding]:
    """One finding per run of consecutive ranks missing the same states: a manifest claiming a
    million ranks gets one line, not a million (and costs the located ranks, not the claimed)."""
    present: dict[int, set[str]] = {}
    for group, rank, state in seen:
        if group == g:
            present.setdefault(rank, set()).add(state)
    everything = sorted(names)
    runs: list[list] = []  # [first rank, last rank, missing states]

    def extend(first: int, last: int, missing: list[str]) -> None:
        if runs and runs[-1][2] == missing and runs[-1][1] == first - 1:
            runs[-1][1] = last
        elif missing:
            runs.append([first, last, missing])

    after = 0  # the first rank not yet looked at
    for rank in sorted(r for r in present if r < ranks):
        if rank > after:
            extend(after, rank - 1, everything)
        extend(rank, rank, sorted(names - present[rank]))
        after = rank + 1
    if after < ranks:
        extend(after, ranks - 1, everything)
    for first, last, missing in runs:
        who = f"rank {first} has" if first == last else f"ranks {first}-{last} have"
        yield finding(
            "CK124",
            json_path("groups", g),
            f"{who} no partition of state(s) {', '.join(map(repr, missing))} of group {g}, which other ranks have",
            "every rank of a group holds a partition of every state of the group; locate them all",
            rank=first,
        )


@rule("CK125")
def state_numel(doc: Document) -> Iterator[Finding]:
    """A state partition holds the group's whole partition_numel on every rank, padding included."""
    for i, j, f, loc in _in_range(doc):
        grp = doc["groups"][loc["group"]]
        if loc["numel"] != grp["partition_numel"]:
            yield finding(
                "CK125",
                json_path("files", i, "state_partitions", j, "numel"),
                f"state {loc['state']!r} of group {loc['group']} rank {loc['rank']} holds {loc['numel']} elements, "
                f"the group's partitions {grp['partition_numel']}",
                "a state partition keeps the whole partition on every rank, padding included (unlike the "
                "master's saved_numels)",
                file=f["path"],
                rank=loc["rank"],
            )


@rule("CK126")
def optimizer_groups(doc: Document) -> Iterator[Finding]:
    """optimizer.groups has one entry per optimizer param group of $.groups, and no other."""
    optimizer = doc.get("optimizer")
    if optimizer is None:
        return
    declared = {g["optimizer_group"] for g in doc["groups"]}
    seen: dict[int, int] = {}
    for k, entry in enumerate(optimizer["groups"]):
        index = entry["optimizer_group"]
        where = json_path("optimizer", "groups", k, "optimizer_group")
        if index in seen:
            yield finding(
                "CK126",
                where,
                f"optimizer group {index} is already described at $.optimizer.groups[{seen[index]}]",
                "describe each optimizer param group once",
            )
        elif index not in declared:
            yield finding(
                "CK126",
                where,
                f"optimizer group {index} holds none of the manifest's groups",
                "optimizer_group is the index of a param group that $.groups[*].optimizer_group names",
            )
        seen.setdefault(index, k)
    missing = sorted(declared - seen.keys())
    if missing:
        yield finding(
            "CK126",
            json_path("optimizer", "groups"),
            f"no entry for optimizer group(s) {', '.join(map(str, missing[:5]))}",
            "describe every optimizer param group that $.groups names",
        )
