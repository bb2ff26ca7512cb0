"""Before a record of a checkpoint's files is replaced (``embed``) or built on (``migrate --checkpoint``):
do the files still match it?

A record written from the files as they are now would describe a damaged file as the right one:
the sizes, hashes and tensor digests that caught the damage would be gone, and ``validate`` and
``reconstruct`` would trust the damage (issue #37, H3). So the files are first checked against
every record being replaced, as ``validate`` checks them (hashes and digests included), and any
error stops the writer unless the caller asks to record the files as they are (``rehash``).
Copies that disagree or cannot be read (CK301, CK302) are no such error: re-embedding repairs them.
"""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.sidecar import find_sidecar
from ...checkpoint.states import StateCache
from ...errors import CkptspecError, RecordMismatch
from ...findings import Finding
from ...format.documents import validate_file
from ...format.models import Manifest
from ...format.tolerant import from_document
from ...format.validate import Report
from ...location import RemotePath
from .domain import check_checkpoint

# Not a reason to stop a writer: the manifest predates an embed, the file is intact (CK227).
NOT_DAMAGE = ("CK227",)


def mismatches(manifest: Manifest, tag_dir: Path | RemotePath, states: StateCache) -> list[Finding]:
    """The errors the files give against ``manifest``'s record of them (what ``validate`` would say)."""
    findings = check_checkpoint(manifest, tag_dir, verify_hashes=True, states=states, verify_digests=True)
    return [f for f in findings if f.severity == "error" and f.code not in NOT_DAMAGE]


def recorded_manifests(tag_dir: Path, given: Manifest | dict | None) -> list[tuple[str, Manifest]]:
    """(name, manifest) of each record of the files a writer would replace: the sidecar, and a
    manifest given that lists files. A sidecar that cannot be read or is not valid records nothing
    a writer could check (``validate`` reports it; ``embed`` repairs it)."""
    out = []
    sidecar = find_sidecar(tag_dir)
    if sidecar is not None:
        try:
            report = validate_file(sidecar)
        except CkptspecError:
            report = None
        if isinstance(report, Report) and report.ok and report.manifest is not None and report.manifest.files:
            out.append((sidecar.name, report.manifest))
    if isinstance(given, dict) and given.get("files"):
        given = from_document(Manifest, given)
    if isinstance(given, Manifest) and given.files and not (out and out[0][1].to_dict() == given.to_dict()):
        out.append(("the manifest given", given))  # (the sidecar itself, given again, is checked once)
    return out


def check_records(
    tag_dir: Path | RemotePath, records: list[tuple[str, Manifest]], states: StateCache, *, rehash: bool, hint: str
) -> list[Finding]:
    """Check the files against each record; raise ``RecordMismatch`` on any error unless ``rehash``,
    else return them (what re-recording replaces)."""
    found: list[Finding] = []
    names = []
    for name, manifest in records:
        new = [f for f in mismatches(manifest, tag_dir, states) if f not in found]
        found += new
        names += [name] if new else []
    if found and not rehash:
        raise RecordMismatch(found, str(tag_dir), f"the files do not match what {' and '.join(names)} records", hint)
    return found
