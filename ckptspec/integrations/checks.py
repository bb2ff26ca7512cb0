"""The verdict on a tag a framework is about to load: the checks of ``ckptspec validate``, errors only."""

from __future__ import annotations

from pathlib import Path

from ..errors import CkptspecError
from ..export.api import validate_checkpoint
from ..findings import Finding, finding


def tag_findings(parent: Path, tag: str, verify_hashes: bool) -> list[Finding]:
    """The errors of tag ``tag`` in ``parent``; a tag that cannot be read at all (CK201-CK203, CK901) is one."""
    try:
        found = validate_checkpoint(str(parent), tag=tag, verify_hashes=verify_hashes)
    except CkptspecError as exc:
        return [finding(exc.code, "$", exc.message, exc.hint, file=exc.file)]
    return [f for f in found if f.severity == "error"]
