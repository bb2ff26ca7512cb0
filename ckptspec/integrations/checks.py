"""The verdict on a tag a framework is about to load: the checks of ``ckptspec validate``, errors only."""

from __future__ import annotations

from pathlib import Path

from ..deepspeed.check.run import tag_verdict
from ..findings import Finding, finding


def tag_findings(parent: Path, tag: str, verify_hashes: bool) -> list[Finding]:
    """The errors of tag ``tag`` in ``parent`` (``scan``'s verdict); a tag that cannot be read at all (CK201-CK203,
    CK901) is one."""
    findings, error = tag_verdict(parent / tag, verify_hashes)
    if error is not None:
        return [finding(error.code, "$", error.message, error.hint, file=error.file)]
    return findings
