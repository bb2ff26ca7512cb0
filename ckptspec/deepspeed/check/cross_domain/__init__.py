"""Cross-domain checks (CK207, CK23x, CK24x): a checkpoint index's files as a whole, after each domain's
own checks (``check.domain``). ``context`` holds the registry and the checks of the file set; the
master families register themselves on import, which this package does once, here."""

from __future__ import annotations

from pathlib import Path

from ....checkpoint.states import StateCache
from ....findings import Finding
from ....format.index_models import CheckpointIndex
from . import master_files, weights_vs_masters  # noqa: F401  (they register CK235 and CK240-CK243)
from .context import INDEX_CHECKS, IndexContext

__all__ = ["INDEX_CHECKS", "check_index_files"]


def check_index_files(
    index: CheckpointIndex, tag_dir: Path, states: StateCache, *, verify_hashes: bool
) -> list[Finding]:
    ctx = IndexContext(index, tag_dir, states, verify_hashes)
    return [found for c in INDEX_CHECKS for found in c.check(ctx)]
