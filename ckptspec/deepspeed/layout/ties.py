"""Candidates for a tie among many entries, found in C: the entries whose key another entry has too.

A tie is two entries with one key (a live parameter's identity or ``ds_id``, a saved tensor's view);
in a model of a million tensors a handful are tied, so the Python that judges a tie should see only
those: counting the keys is done by ``Counter`` in C, the picking by ``compress``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import compress
from typing import Any, TypeVar

Row = TypeVar("Row")


def repeated(rows: Iterable[Row], keys: Iterable[Any]) -> Iterator[Row]:
    """The ``rows`` (aligned with ``keys``) whose key another row also has, in order."""
    keys = list(keys)
    counts = Counter(keys)
    if len(counts) == len(keys):
        return iter(())
    shared = {key for key, n in counts.items() if n > 1}
    return compress(rows, map(shared.__contains__, keys))
