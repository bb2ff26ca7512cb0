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


def located(doc: Document, key: str) -> Iterator[tuple[int, int, dict, dict]]:
    """(file index, locator index, file, locator) of every locator in ``files[*][key]`` (format 1.1's
    ``tensors``, ``model_weights``, ``state_partitions``: absent in 1.0 documents)."""
    for i, f in enumerate(doc["files"]):
        for j, loc in enumerate(f.get(key, ())):
            yield i, j, f, loc


# Every kind of locator of a file entry, by key (1.0 has partitions only).
LOCATOR_KEYS = ("partitions", "tensors", "model_weights", "state_partitions")
