"""CK103-CK105: aliases point straight at a declared tensor of their own shape."""

from __future__ import annotations

from collections.abc import Iterator

from ...findings import Finding, RuleSet, finding, json_path
from .document import Document, RuleFn

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


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
                f"alias {alias['name']!r} has shape {alias['shape']} but its owner {alias['owner']!r} has "
                f"{owner_shape}",
                "a tied tensor has its owner's shape; a mismatch means the tie was inferred wrongly",
            )
