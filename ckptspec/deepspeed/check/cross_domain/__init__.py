"""Cross-domain checks (CK207, CK23x, CK24x): a checkpoint index's files as a whole, after each domain's
own checks (``check.domain``). ``context`` holds the registry and the checks of the file set; the
master families register themselves on import, which this package does once, here."""

from __future__ import annotations

from pathlib import Path

from ....checkpoint.states import StateCache
from ....findings import Finding
from ....format.index_models import CheckpointIndex
from ....location import RemotePath
from . import master_files, weights_vs_masters  # noqa: F401  (they register CK235 and CK240-CK243)
from .context import INDEX_CHECKS, IndexContext

__all__ = ["INDEX_CHECKS", "check_index_files"]


HASHING = ("CK230", "CK241")  # the checks that hash whole files (with ``verify_hashes``)


def check_index_files(
    index: CheckpointIndex, tag_dir: Path | RemotePath, states: StateCache, *, verify_hashes: bool
) -> list[Finding]:
    ctx = IndexContext(index, tag_dir, states, verify_hashes)
    checks = list(INDEX_CHECKS)
    if not (verify_hashes and isinstance(tag_dir, RemotePath)):
        return [found for c in checks for found in c.check(ctx)]
    # A remote file's hash reads it whole and keeps none of it: the checks that hash files (layer and
    # expert files) run last, after the few bytes the others compare are fetched; findings in check order.
    last = [i for i, c in enumerate(checks) if c.code in HASHING]
    found = {i: list(c.check(ctx)) for i, c in enumerate(checks) if i not in last}
    found.update({i: list(checks[i].check(ctx)) for i in last})
    return [f for i in range(len(checks)) for f in found[i]]
