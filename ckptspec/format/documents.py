"""Any document, any kind: the one place that tells a manifest 1.x from a checkpoint index and a torch DCP
document by its ``format`` and hands it to that kind's module (validation: ``validate.py``, ``index_validate.py``,
``dcp_validate.py``; migration: ``migrate.py``, ``index_migrate.py``), so no kind's module imports another's.

``validate`` and ``load`` (``ckptspec.validate``, ``ckptspec.load``) take every kind, as
``jsonschema.validators.validator_for`` picks a validator by ``$schema``; ``load_manifest`` and
``validate_document`` read manifests only and refuse an index by name (``CK005``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import InvalidManifest
from ..findings import Finding, finding
from ..location import AnyPath
from .codec import DEFAULT_MAX_BYTES, Encoding, gc_paused, read_document
from .dcp_validate import DcpReport, is_dcp_document, validate_dcp_document
from .index_validate import IndexReport, is_index, validate_index_document
from .validate import Report, validate_decoded
from .validate import validate_document as validate_manifest_document

if TYPE_CHECKING:
    from .dcp_models import DcpDocument
    from .index_models import CheckpointIndex
    from .migrate import MigrationResult
    from .models import Manifest

_LOAD_HINT = (
    "ckptspec.load reads every kind (a Manifest, a CheckpointIndex, a DcpDocument); ckptspec.validate validates any"
)


def _not_a_manifest(doc: Any = None) -> Finding:
    what = (
        "a torch DCP document (format ckptspec.dcp)"
        if is_dcp_document(doc)
        else "a checkpoint index (format ckptspec.checkpoint)"
    )
    return finding("CK005", "$.format", f"this is {what}, not a manifest", _LOAD_HINT)


def validate_file(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
    *,
    build_model: bool = True,
    reference: bool = False,
) -> Report | IndexReport | DcpReport:
    """Load and validate a manifest file, or a checkpoint index (an ``IndexReport`` then: the same
    ``ok``, ``findings`` and ``manifest``, which is the index), or a torch DCP document (a ``DcpReport``).
    Raises ``CkptspecError`` when it cannot be read."""
    return read_and_validate(path, max_bytes, encoding, build_model=build_model, reference=reference)[1]


def read_and_validate(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
    *,
    build_model: bool = True,
    reference: bool = False,
) -> tuple[Any, Report | IndexReport | DcpReport]:
    """``validate_file``, also giving the decoded document (plain data, left as decoded), so that a
    caller comparing it with other copies does not read the file again."""
    with gc_paused():
        doc, floats = read_document(path, max_bytes, encoding)
        if is_index(doc):
            return doc, validate_index_document(doc)
        if is_dcp_document(doc):
            return doc, validate_dcp_document(doc)
        return doc, validate_decoded(doc, floats, build_model=build_model, reference=reference)


def load_manifest(path: str | os.PathLike, **kwargs) -> Manifest:
    """Load a manifest that must be valid; raises ``InvalidManifest`` listing the findings (CK005
    for a checkpoint index, which ``load`` reads)."""
    report = validate_file(path, **kwargs)
    if not isinstance(report, Report):
        raise InvalidManifest(
            str(path), [_not_a_manifest({"format": "ckptspec.dcp"} if isinstance(report, DcpReport) else None)]
        )
    if not report.ok or report.manifest is None:
        raise InvalidManifest(str(path), report.findings)
    return report.manifest


def validate_document(doc: Any, *, build_model: bool = True, reference: bool = False) -> Report:
    """Validate already-decoded manifest data (``ckptspec.validate_document``); a checkpoint index is
    one finding, ``CK005``, not the manifest schema's errors on it (``validate`` reads either)."""
    if is_index(doc) or is_dcp_document(doc):
        return Report([_not_a_manifest(doc)])
    return validate_manifest_document(doc, build_model=build_model, reference=reference)


def validate(document_or_path: Any, **kwargs: Any) -> Report | IndexReport | DcpReport:
    """Validate a document of either kind, by its ``format``: a path (or an ``os.PathLike``; JSON or
    msgpack, local or a URL) is read first, as ``validate_file`` does; anything else is decoded data
    (a ``dict``). Gives a ``Report`` for a manifest, an ``IndexReport`` for a checkpoint index: both
    have ``ok``, ``findings`` and ``manifest`` (the model of either kind, or None). ``kwargs`` are
    ``validate_file``'s (a path) or ``validate_document``'s (data); ``reference`` and ``build_model``
    concern manifests only.
    """
    if isinstance(document_or_path, (str, os.PathLike)):
        return validate_file(document_or_path, **kwargs)
    if is_index(document_or_path):
        return validate_index_document(document_or_path)
    if is_dcp_document(document_or_path):
        return validate_dcp_document(document_or_path)
    return validate_manifest_document(document_or_path, **kwargs)


def load(path: str | os.PathLike, **kwargs: Any) -> Manifest | CheckpointIndex | DcpDocument:
    """Read a document that must be valid: a ``Manifest`` or a ``CheckpointIndex``, by its
    ``format``. Raises ``InvalidManifest`` listing the findings (``CkptspecError`` when it cannot be
    read). ``kwargs`` are ``validate_file``'s."""
    report = validate_file(path, **kwargs)
    if not report.ok or report.manifest is None:
        raise InvalidManifest(str(path), report.findings)
    return report.manifest


def validate_at_own_version(doc: Any) -> list[Finding]:
    """The findings of decoded data of either kind as ``convert``, ``embed --manifest`` and ``migrate``
    read it: a manifest against its own version, drafts registered with ``migrate.register_schema``
    included (``migrate.validate_own_version``); a checkpoint index as ``validate`` reads it."""
    if is_index(doc):
        return validate_index_document(doc).findings
    if is_dcp_document(doc):
        return validate_dcp_document(doc).findings
    from .migrate import validate_own_version

    return validate_own_version(doc)


def migrate(doc: Any, to_version: str, name: str = "<input>") -> MigrationResult:
    """Migrate decoded data of either kind to manifest format ``to_version``: a manifest itself
    (``migrate.migrate_document``), a checkpoint index the manifest of each domain, the index's
    own version unchanged (``index_migrate.migrate_index``)."""
    if is_index(doc):
        from .index_migrate import migrate_index

        return migrate_index(doc, to_version, name)
    if is_dcp_document(doc):  # one version so far: nothing to migrate to
        from ..errors import MigrationError

        raise MigrationError(
            "CK311",
            f"no migration of a torch DCP document (format ckptspec.dcp) to {to_version}",
            "ckptspec.dcp has one version, 1.0; `ckptspec generate DCP_DIR` writes it",
            name,
        )
    from .migrate import migrate_document

    return migrate_document(doc, to_version, name)


__all__ = [
    "load",
    "load_manifest",
    "migrate",
    "read_and_validate",
    "validate",
    "validate_at_own_version",
    "validate_document",
    "validate_file",
]
