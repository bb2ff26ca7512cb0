"""Validate a torch DCP document (``"format": "ckptspec.dcp"``): version gate, its JSON Schema, the models, the
CK7xx rules. ``is_dcp_document`` tells it from the other kinds by its ``format`` (``documents.py`` dispatches)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..findings import Finding, finding, has_errors, json_path
from .codec import gc_paused
from .dcp_rules import check_dcp_rules
from .schemas import DCP_SCHEMAS, LATEST_DCP, schema, schema_findings
from .version import line_version_findings

if TYPE_CHECKING:
    from .dcp_models import DcpDocument

DCP_FORMAT = "ckptspec.dcp"
DCP_MAJOR, DCP_MINOR = (int(x) for x in LATEST_DCP.split("."))


def is_dcp_document(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("format") == DCP_FORMAT


@dataclass
class DcpReport:
    findings: list[Finding] = field(default_factory=list)
    document: DcpDocument | None = None

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)

    @property
    def manifest(self) -> DcpDocument | None:  # the name callers of a 1.x Report use
        return self.document


def _version_findings(doc: dict) -> tuple[list[Finding], bool]:
    return line_version_findings(
        doc,
        "DCP document",
        (DCP_MAJOR, DCP_MINOR),
        "upgrade ckptspec, or describe the checkpoint again with `ckptspec generate`",
    )


def validate_dcp_document(doc: Any) -> DcpReport:
    """Validate decoded DCP document data; ``DcpReport.document`` is the model when the schema accepts it."""
    from pydantic import ValidationError

    from .dcp_models import DcpDocument
    from .integral import integral_floats
    from .tolerant import tolerant

    with gc_paused():
        gate, stop = _version_findings(doc)
        if stop:
            return DcpReport(gate)
        allow_unknown = any(f.code == "CK004" for f in gate)
        own = ".".join(str(doc.get("format_version")).split(".")[:2])
        findings = gate + schema_findings(
            doc,
            schema(DCP_SCHEMAS.get(own, DCP_SCHEMAS[LATEST_DCP])),
            allow_unknown=allow_unknown,
            rules_of="(see docs/spec-dcp.md)",
        )
        if has_errors(findings):
            return DcpReport(findings)
        model = tolerant(DcpDocument) if allow_unknown else DcpDocument
        doc = integral_floats(doc, DcpDocument)  # JSON Schema's 3.0 is an integer: the models and rules count
        try:
            document = model.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            return DcpReport(
                findings
                + [
                    finding(
                        "CK002",
                        json_path(*first["loc"]),
                        f"the schema accepts this document but the models refuse it: {first['msg']}",
                        "please report this ckptspec bug with the document attached",
                    )
                ]
            )
        return DcpReport(findings + check_dcp_rules(doc), document)
