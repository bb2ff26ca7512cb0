"""Validate a checkpoint index document: version gate, its JSON Schema, every domain's 1.x manifest
(its own schema and rules, findings under ``$.domains[i].manifest``), the models, the CK6xx rules.

``is_index`` tells an index from a manifest by its ``format``: the one dispatch the CLI and the
loaders use (a 1.x reader handed an index refuses it with CK001 on ``format``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidManifest
from ..findings import Finding, finding, has_errors, json_path
from . import index_extras_rules  # noqa: F401  (registers CK610 with the index rules)
from .codec import DEFAULT_MAX_BYTES, Encoding, gc_paused, read_document
from .index_rules import check_index_rules
from .schemas import INDEX_SCHEMAS, LATEST_INDEX, fast_accepts, schema, schema_findings
from .validate import validate_document
from .version import line_version_findings

if TYPE_CHECKING:
    from .index_models import CheckpointIndex

INDEX_FORMAT = "ckptspec.checkpoint"
INDEX_MAJOR, INDEX_MINOR = (int(x) for x in LATEST_INDEX.split("."))


def is_index(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("format") == INDEX_FORMAT


@dataclass
class IndexReport:
    findings: list[Finding] = field(default_factory=list)
    index: CheckpointIndex | None = None

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def manifest(self) -> CheckpointIndex | None:  # the name callers of a 1.x Report use
        return self.index


RULES_OF = "(see docs/spec-checkpoint.md)"


def _version_findings(doc: dict) -> tuple[list[Finding], bool]:
    return line_version_findings(doc, "checkpoint index", (INDEX_MAJOR, INDEX_MINOR), "upgrade ckptspec")


def _prefixed(found: Finding, *parts: str | int) -> Finding:
    """A domain manifest's finding, its JSON path made a path into the index."""
    return dataclasses.replace(found, path=json_path(*parts) + found.path[1:])


def validate_index_document(doc: Any) -> IndexReport:
    """Validate decoded index data; ``IndexReport.index`` is the model when the document is valid
    enough to build one (no schema error, no domain manifest refused by its schema)."""
    from pydantic import ValidationError

    from .index_models import CheckpointIndex
    from .integral import integral_floats
    from .tolerant import tolerant

    with gc_paused():
        gate, stop = _version_findings(doc)
        if stop:
            return IndexReport(gate)
        allow_unknown = any(f.code == "CK004" for f in gate)
        # the schema of the document's own minor (a 1.0 index with a 1.1 field is CK001), the latest for a newer one
        own = ".".join(str(doc.get("format_version")).split(".")[:2])
        filename = INDEX_SCHEMAS.get(own, INDEX_SCHEMAS[LATEST_INDEX])
        findings = list(gate)
        # The compiled validator first (docs/performance.md); only a document it refuses, or a newer minor's (whose
        # unknown fields it refuses), goes to the reference, which gives the findings.
        if allow_unknown or not fast_accepts(filename, doc):
            findings += schema_findings(doc, schema(filename), allow_unknown=allow_unknown, rules_of=RULES_OF)
        if has_errors(findings):
            return IndexReport(findings)
        refused = False
        for i, dom in enumerate(doc["domains"]):
            report = validate_document(dom["manifest"], build_model=False)
            findings += [_prefixed(f, "domains", i, "manifest") for f in report.findings]
            refused = refused or any(f.code in ("CK001", "CK002", "CK003") for f in report.findings)
        if refused:
            return IndexReport(findings)
        model = tolerant(CheckpointIndex) if allow_unknown else CheckpointIndex
        # The models are strict, and the rules count with the degrees: JSON Schema's integral floats
        # (3.0) become ints first, for both.
        doc = integral_floats(doc, CheckpointIndex)
        try:
            index = model.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            return IndexReport(
                findings
                + [
                    finding(
                        "CK002",
                        json_path(*first["loc"]),
                        f"the schema accepts this index but the models refuse it: {first['msg']}",
                        "please report this ckptspec bug with the document attached",
                    )
                ]
            )
        return IndexReport(findings + check_index_rules(doc), index)


def validate_index(index: CheckpointIndex) -> IndexReport:
    """Validate a producer's index (the model's own dump)."""
    report = validate_index_document(index.to_dict())
    return IndexReport(report.findings, index if report.index is not None else None)


def validate_index_file(
    path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, encoding: Encoding | None = None
) -> IndexReport:
    doc, _ = read_document(path, max_bytes, encoding)
    return validate_index_document(doc)


def load_index(path: str | os.PathLike, **kwargs) -> CheckpointIndex:
    report = validate_index_file(path, **kwargs)
    if not report.ok or report.index is None:
        raise InvalidManifest(str(path), report.findings)
    return report.index
