"""The decoded manifest document as the rules read it: plain dicts and lists, integers as ``int``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ...findings import Finding

Document = dict[str, Any]
RuleFn = Callable[[Document], Iterator[Finding]]


def params(doc: Document) -> Iterator[tuple[int, int, dict]]:
    """(group index, param index, param) of every trainable parameter, in document order."""
    for g, grp in enumerate(doc["groups"]):
        for p, t in enumerate(grp["params"]):
            yield g, p, t


def flat_end(params: list[dict]) -> int:
    """Where a flat group's last parameter (and its padding) ends."""
    if not params:
        return 0
    last = params[-1]
    return last["offset"] + last["numel"] + last["padding"]
