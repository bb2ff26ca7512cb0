"""CK101-CK102: every tensor's numel and name."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ...findings import Finding, RuleSet, finding, json_path
from .document import Document, RuleFn, params

RULES: RuleSet[RuleFn] = RuleSet()
rule = RULES.register


@rule("CK101")
def numel_matches_shape(doc: Document) -> Iterator[Finding]:
    """numel == product(shape); [] is a 0-d tensor (numel 1), a 0 in the shape gives 0."""
    prod = math.prod
    sections: list[tuple[tuple[str | int, ...], Any]] = [
        (("groups", g, "params"), grp["params"]) for g, grp in enumerate(doc["groups"])
    ]
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
    for g, p, t in params(doc):
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
