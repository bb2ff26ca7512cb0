"""The CK2xx checks: a checkpoint's files against its manifest, before any reconstruction.

One check = one function = one stable code, as in ``ckptspec.format.rules``; each check
yields every finding it sees, with ``file`` (relative to the tag directory) and ``rank``
set and a JSON path into the manifest when one applies. ``docs/validation.md`` documents
every check. The checks are grouped by what they read: the files themselves (``files``),
their headers (``headers``), the flat master partitions (``partitions``), the saved
module (``module``) and its weights against the masters (``weights``).

Only metadata is read: each ``.pt`` file's ``data.pkl`` through the restricted unpickler
(never ``torch.load``, so no pickled code runs) and the zip directory, once per file
through a ``StateCache``. Tensor bytes are read to verify recorded hashes, and a few elements of
each rank's masters and weights to compare them (``weights``, CK235). A file
that cannot be read becomes a finding naming it; the other files are still checked.

When the manifest is generated from the same files (``validate DIR`` without a sidecar),
its arithmetic comes from DeepSpeed's ``param_shapes``; the checks compare it with what the
shard files really hold (partition numels, module tensor shapes and flat-buffer offsets,
``param_slice_mappings``, per-file headers), so a corrupt ``param_shapes`` is still caught.
"""

from __future__ import annotations

import json
import os

from ...._forked import Forked
from ....checkpoint.states import StateCache
from ....errors import InputOutputError
from ....findings import Finding, RuleSet
from ....format.models import Manifest
from ....location import RemotePath, location
from . import files, headers, module, partitions, tensors, weights
from .context import Check, build_context

FORK_MIN_PARAMS = 30_000  # below this the checks end before a second process would start
# The order the checks run in, and so the order of their findings.
CHECKS: RuleSet[Check] = RuleSet(
    files.CHECKS, headers.CHECKS, partitions.CHECKS, module.CHECKS, tensors.CHECKS, weights.CHECKS
)


def check_checkpoint(
    manifest: Manifest,
    tag_dir: str | os.PathLike | RemotePath,
    *,
    verify_hashes: bool = True,
    states: StateCache | None = None,
    verify_digests: bool | None = None,
    scope=None,
) -> list[Finding]:
    """Check the files of ``tag_dir`` against ``manifest`` (which should already be valid).

    Reads only metadata, plus every file's bytes when ``verify_hashes`` and the manifest
    records hashes, and every located tensor's bytes when ``verify_digests`` (default:
    ``verify_hashes``) and the manifest records tensor digests. Returns the findings of every
    check, in check order. ``states``: files already read, and where the files read here are kept.
    A large manifest's checks are shared with a forked process only when ``CKPTSPEC_WORKERS=2``.
    """
    tag_dir = location(tag_dir)
    if not tag_dir.is_dir():
        raise InputOutputError("CK901", "checkpoint tag directory not found", "check the path", str(tag_dir))
    digests = verify_hashes if verify_digests is None else verify_digests
    ctx = build_context(
        manifest, tag_dir, verify_hashes, states if states is not None else StateCache(), digests, scope
    )
    return files.whole_save_differs(ctx, _run_remote(ctx) if isinstance(tag_dir, RemotePath) else _run(ctx))


READ_EVERY_BYTE = ("CK209", "CK222")  # the checks that read every byte of a file or tensor (with hashes)


def _run_remote(ctx) -> list[Finding]:
    """Every check's findings, in check order, all in this process (what they fetch is counted, and
    kept for the checks after them), the two that read every byte last: the bytes the others
    fetched (the optimizers' steps) are then taken from memory, so each byte is fetched once."""
    checks = list(CHECKS)
    found = {c.code: list(c.check(ctx)) for c in checks if c.code not in READ_EVERY_BYTE}
    found.update({c.code: list(c.check(ctx)) for c in checks if c.code in READ_EVERY_BYTE})
    return [f for c in checks for f in found[c.code]]


def _run(ctx) -> list[Finding]:
    """Every check's findings, in check order. A large manifest's checks are shared with a forked
    copy of this process, which runs every other one and sends back its findings as JSON
    (``_forked``); if it fails, or a check here raises, everything runs here, in order."""
    checks = list(CHECKS)
    if sum(len(group.params) for group in ctx.manifest.groups) < FORK_MIN_PARAMS:
        return [found for check in checks for found in check.check(ctx)]
    theirs = checks[1::2]
    with Forked(lambda: json.dumps([[f.to_dict() for f in check.check(ctx)] for check in theirs]).encode()) as child:
        try:
            mine = [list(check.check(ctx)) for check in checks[0::2]]
        except Exception:
            mine = None
        sent = child.result()
    if mine is None or sent is None:
        return [found for check in checks for found in check.check(ctx)]
    received = [[Finding(**f) for f in found] for found in json.loads(sent)]
    in_order: list[list[Finding]] = [[] for _ in checks]
    in_order[0::2], in_order[1::2] = mine, received
    return [found for part in in_order for found in part]


__all__ = ["CHECKS", "check_checkpoint"]
