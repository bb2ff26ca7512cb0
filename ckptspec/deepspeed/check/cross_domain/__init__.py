"""Cross-domain checks (CK207, CK23x, CK24x): a checkpoint index's files as a whole, after each domain's
own checks (``check.domain``). ``context`` holds the registry and the checks of the file set; the
master families register themselves on import, which this package does once, here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ....checkpoint.states import StateCache
from ....findings import Finding
from ....format.index_models import CheckpointIndex
from ....location import RemotePath
from . import copies, master_files, weights_vs_masters  # noqa: F401  (they register CK235, CK237 and CK240-CK243)
from .context import INDEX_CHECKS, IndexContext

__all__ = ["INDEX_CHECKS", "check_index_files_in_two"]


HASHING = ("CK230", "CK241")  # the checks that hash whole files (with ``verify_hashes``)


def check_index_files_in_two(
    index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache, *, verify_hashes: bool
) -> tuple[dict[int, list[Finding]], Callable[[], list[Finding]]]:
    """The checks of an index's files as a whole, in two parts: now, the checks that read a few bytes; later
    (the callable, after every domain's checks), those that hash whole files (layer and expert files). A
    remote file's hash reads it whole and keeps none of it, so the reads of a file come before its hash
    and each byte is fetched once; the callable gives every finding in check order."""
    ctx = IndexContext(index, tag_dir, states, verify_hashes)
    checks = list(INDEX_CHECKS)
    last = [i for i, c in enumerate(checks) if c.code in HASHING] if verify_hashes else []
    found = {i: list(c.check(ctx)) for i, c in enumerate(checks) if i not in last}

    def rest() -> list[Finding]:
        found.update({i: list(checks[i].check(ctx)) for i in last})
        return [f for i in range(len(checks)) for f in found[i]]

    return found, rest
