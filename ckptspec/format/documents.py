"""Any document file, either kind: the one place that tells a manifest 1.x from a checkpoint index
by its ``format`` and hands it to that kind's validator (``validate.py``, ``index_validate.py``), so
neither kind's module imports the other."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..errors import InvalidManifest
from ..findings import finding
from ..location import AnyPath
from .codec import DEFAULT_MAX_BYTES, Encoding, gc_paused, read_document
from .index_validate import IndexReport, is_index, validate_index_document
from .validate import Report, validate_decoded

if TYPE_CHECKING:
    from .models import Manifest


def validate_file(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
    *,
    build_model: bool = True,
    reference: bool = False,
) -> Report | IndexReport:
    """Load and validate a manifest file, or a checkpoint index (an ``IndexReport`` then: the same
    ``ok``, ``findings`` and ``manifest``, which is the index). Raises ``CkptspecError`` when it
    cannot be read."""
    return read_and_validate(path, max_bytes, encoding, build_model=build_model, reference=reference)[1]


def read_and_validate(
    path: AnyPath,
    max_bytes: int = DEFAULT_MAX_BYTES,
    encoding: Encoding | None = None,
    *,
    build_model: bool = True,
    reference: bool = False,
) -> tuple[Any, Report | IndexReport]:
    """``validate_file``, also giving the decoded document (plain data, left as decoded), so that a
    caller comparing it with other copies does not read the file again."""
    with gc_paused():
        doc, floats = read_document(path, max_bytes, encoding)
        if is_index(doc):
            return doc, validate_index_document(doc)
        return doc, validate_decoded(doc, floats, build_model=build_model, reference=reference)


def load_manifest(path: str | os.PathLike, **kwargs) -> Manifest:
    """Load a manifest that must be valid; raises ``InvalidManifest`` listing the findings (CK005
    for a checkpoint index, which ``index_validate.load_index`` reads)."""
    report = validate_file(path, **kwargs)
    if not isinstance(report, Report):
        where = "a checkpoint index (format ckptspec.checkpoint), not a manifest"
        hint = "read it with ckptspec.format.index_validate.load_index; ckptspec.validate_file validates either"
        raise InvalidManifest(str(path), [finding("CK005", "$.format", f"this is {where}", hint)])
    if not report.ok or report.manifest is None:
        raise InvalidManifest(str(path), report.findings)
    return report.manifest


__all__ = ["load_manifest", "read_and_validate", "validate_file"]
