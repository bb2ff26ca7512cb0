"""Validate a manifest document: version gate, JSON Schema, models, semantic rules.

The JSON Schema is the reference: when it rejects a document, its errors are the
findings and the semantic rules do not run (they need well-typed data).

Two paths give the same verdict (``tests/unit/format/test_fast_path.py`` proves it on the whole
conformance corpus):

* fast: a compiled validator (``jsonschema-rs``) answers "valid?", and the semantic
  rules read the decoded document directly; the Pydantic models are built only when
  the caller wants them. A million-parameter manifest validates in seconds.
* reference: ``jsonschema`` (pure Python, the normative engine) and the models. It
  runs whenever the fast validator rejects the document, so findings always come
  from the reference engine, and on request (``reference=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..findings import Finding, finding, has_errors, json_path
from .codec import gc_paused
from .rules import check_document
from .schemas import fast_accepts, manifest_schema_file, schema_findings, schema_version_of
from .version import version_findings

if TYPE_CHECKING:
    from .models import Manifest


@dataclass
class Report:
    """The outcome of validating one document."""

    findings: list[Finding] = field(default_factory=list)
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)


def fast_schema_accepts(doc: Any) -> bool:
    """The compiled validator's verdict on the schema of the document's version; False when unsure
    (then the reference decides)."""
    return fast_accepts(manifest_schema_file(schema_version_of(doc)), doc)


def _build_model(doc: Any, allow_unknown: bool) -> tuple[Manifest | None, Finding | None]:
    """The Pydantic view of a schema-valid document (integral floats already integers), or the
    finding saying why not. ``allow_unknown``: a newer minor's, read by the models' tolerant twins."""
    from pydantic import ValidationError

    from .models import Manifest
    from .tolerant import tolerant

    try:
        return (tolerant(Manifest) if allow_unknown else Manifest).model_validate(doc), None
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "string_unicode":
            # Decoded data (not from our loader) may hold a lone surrogate: not Unicode text.
            return None, finding(
                "CK001",
                json_path(*first["loc"]),
                "string is not valid Unicode (a lone surrogate)",
                "manifest strings must be Unicode text",
            )
        # The schema accepted what the models refuse: a bug in ckptspec, not the input.
        return None, finding(
            "CK002",
            json_path(*first["loc"]),
            f"the schema accepts this document but the models refuse it: {first['msg']}",
            "please report this ckptspec bug with the manifest attached",
        )


def _validate(doc: Any, *, plain: bool, build_model: bool, reference: bool) -> Report:
    findings: list[Finding] = []
    allow_unknown = False
    if isinstance(doc, dict):
        gate, stop = version_findings(doc)
        findings += gate
        if stop:
            return Report(findings)
        allow_unknown = any(f.code == "CK004" for f in gate)
    # A newer minor's unknown fields fail the compiled check: the reference skips them.
    if reference or allow_unknown or not fast_schema_accepts(doc):
        findings += schema_findings(doc, allow_unknown=allow_unknown)
        if has_errors(findings):
            return Report(findings)
    # A document from the loader holds Unicode strings only; without floats its numbers
    # are plain ints and the rules read it as it is. Anything else (3.0 for a count, a
    # lone surrogate in data from elsewhere) is normalized first (integral floats made ints)
    # and read back from the models.
    rules_read_doc = plain and not reference
    manifest = None
    if build_model or not rules_read_doc:
        if not plain:
            from .integral import integral_floats
            from .models import Manifest

            doc = integral_floats(doc, Manifest)
        manifest, failure = _build_model(doc, allow_unknown)
        if failure is not None:
            return Report(findings + [failure])
    try:
        # the model was built above unless the rules read the document itself
        checked = doc if rules_read_doc or manifest is None else manifest.to_dict()
    except UnicodeEncodeError:
        # The models keep a newer minor's unknown fields as they are, lone surrogates included,
        # and cannot serialize them.
        return Report(
            findings
            + [
                Finding(
                    "CK001",
                    "schema",
                    _lone_surrogate_path(doc),
                    "string is not valid Unicode (a lone surrogate)",
                    "manifest strings must be Unicode text",
                )
            ]
        )
    findings += check_document(checked)
    return Report(findings, manifest)


def _lone_surrogate_path(doc: Any) -> str:
    """The JSON path of the first string (key or value) that is not Unicode text."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(doc, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return json_path(*where)
        elif isinstance(value, dict):
            stack.extend((k, where + (k,)) for k in value)
            stack.extend((v, where + (k,)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, where + (i,)) for i, v in enumerate(value))
    return "$"


def validate_document(doc: Any, *, build_model: bool = True, reference: bool = False) -> Report:
    """Validate already-decoded manifest data.

    ``build_model=False`` skips the Pydantic models when only the verdict is wanted
    (``Report.manifest`` is then None). ``reference=True`` uses only the reference
    engine (``jsonschema``) and the models: slower, same verdict.
    """
    with gc_paused():
        return _validate(doc, plain=False, build_model=build_model, reference=reference)


def validate_manifest(manifest: Manifest, doc: dict | None = None) -> Report:
    """Validate a model, e.g. a producer's output, without building it a second time.

    ``doc`` is the document to check, by default ``manifest.to_dict()``: a model's dump
    holds plain ints and Unicode text only, so the rules read it as it is.
    ``Report.manifest`` is ``manifest`` unless the schema refuses the document.
    """
    with gc_paused():
        report = _validate(manifest.to_dict() if doc is None else doc, plain=True, build_model=False, reference=False)
    schema_refused = any(f.code in ("CK001", "CK002", "CK003") for f in report.findings)
    return Report(report.findings, None if schema_refused else manifest)


def validate_decoded(doc: Any, floats: bool, *, build_model: bool = True, reference: bool = False) -> Report:
    """Validate what ``codec.read_document`` returned (``floats``: the document holds floats)."""
    with gc_paused():
        return _validate(doc, plain=not floats, build_model=build_model, reference=reference)


__all__ = ["Report", "validate_decoded", "validate_document", "validate_manifest"]
