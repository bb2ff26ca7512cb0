"""Before a record of a checkpoint's files is replaced (``embed``) or built on (``migrate --checkpoint``):
do the files still match it?

A record written from the files as they are now would describe a damaged file as the right one:
the sizes, hashes and tensor digests that caught the damage would be gone, and ``validate`` and
``reconstruct`` would trust the damage (issue #37, H3). So the files are first checked against
every record being replaced, as ``validate`` checks them (hashes and digests included), and any
error stops the writer unless the caller asks to record the files as they are (``rehash``).
Copies that disagree or cannot be read (CK301, CK302) are no such error: re-embedding repairs them.
A record is a format 1.x manifest or a checkpoint index (the sidecar of a tensor/pipeline-parallel, MoE or stage-0
checkpoint), each checked as ``validate`` checks it.
"""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.sidecar import find_sidecar
from ...checkpoint.states import StateCache
from ...errors import CkptspecError, RecordMismatch
from ...findings import Finding
from ...format.documents import validate_file
from ...format.index_models import CheckpointIndex
from ...format.index_validate import IndexReport, is_index, validate_index_document
from ...format.models import Manifest
from ...format.tolerant import from_document
from ...format.validate import Report
from ...location import RemotePath
from .checkpoint_index import validate_index_checkpoint
from .domain import check_checkpoint

Record = Manifest | CheckpointIndex

# Not a reason to stop a writer: the manifest predates an embed, the file is intact (CK227).
NOT_DAMAGE = ("CK227",)


def mismatches(record: Record, tag_dir: Path | RemotePath, states: StateCache) -> list[Finding]:
    """The errors the files give against ``record`` (what ``validate`` would say)."""
    if isinstance(record, CheckpointIndex):
        _, findings = validate_index_checkpoint(tag_dir, record, verify_hashes=True, states=states, verify_digests=True)
    else:
        findings = check_checkpoint(record, tag_dir, verify_hashes=True, states=states, verify_digests=True)
    return [f for f in findings if f.severity == "error" and f.code not in NOT_DAMAGE]


def recorded_manifests(tag_dir: Path, given: Manifest | CheckpointIndex | dict | None) -> list[tuple[str, Record]]:
    """(name, record) of each record of the files a writer would replace: the sidecar (a manifest or a
    checkpoint index), and a document given that lists files. A sidecar that cannot be read or is not
    valid records nothing a writer could check (``validate`` reports it; ``embed`` repairs it)."""
    out: list[tuple[str, Record]] = []
    sidecar = find_sidecar(tag_dir)
    if sidecar is not None:
        try:
            report = validate_file(sidecar)
        except CkptspecError:
            report = None
        record = report.manifest if isinstance(report, (Report, IndexReport)) and report.ok else None
        if record is not None and _lists_files(record):
            out.append((sidecar.name, record))
    if isinstance(given, dict) and is_index(given):
        given = validate_index_document(given).index  # the model validate checks with (None: not valid)
    elif isinstance(given, dict) and given.get("files"):
        given = from_document(Manifest, given)
    if isinstance(given, (Manifest, CheckpointIndex)) and _lists_files(given):
        if not (out and out[0][1].to_dict() == given.to_dict()):  # (the sidecar itself, given again: checked once)
            out.append(("the manifest given", given))
    return out


def _lists_files(record: Record) -> bool:
    if isinstance(record, CheckpointIndex):
        return any(d.manifest.files for d in record.domains) or bool(record.layer_files or record.expert_files)
    return isinstance(record, Manifest) and bool(record.files)


def check_records(
    tag_dir: Path | RemotePath, records: list[tuple[str, Record]], states: StateCache, *, rehash: bool, hint: str
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
