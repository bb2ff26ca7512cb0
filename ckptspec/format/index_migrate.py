"""Migrate a checkpoint index: the ``ckptspec.manifest`` of each of its domains.

The index has one version of its own (``ckptspec.checkpoint`` 1.0) and no migration; its schema
takes any 1.x manifest as a domain's ``manifest`` (docs/spec-checkpoint.md#domains), and each keeps
its own version (docs/versioning.md). So migrating an index to manifest format ``V`` migrates every
domain's manifest to ``V`` with the registered migrations (``migrate.py``) and leaves everything
else as it is. The index is validated whole before (an invalid one: ``InvalidInput``) and after
(``CK312``: nothing is handed out that its reader would refuse).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..errors import InvalidInput, MigrationError
from ..findings import Finding, has_errors, json_path
from .index_validate import validate_index_document
from .migrate import MigrationResult, migrate_document
from .version import version_key


def _in_domain(found: Finding, i: int) -> Finding:
    """A domain manifest's finding, its JSON path made a path into the index."""
    return dataclasses.replace(found, path=json_path("domains", i, "manifest") + found.path[1:])


def migrate_index(doc: dict, to_version: str, name: str = "<input>") -> MigrationResult:
    """Migrate every domain manifest of a decoded checkpoint index to manifest format ``to_version``.

    ``MigrationResult.steps`` are the distinct steps taken (domains already at the target take none);
    its findings are the input's warnings and the dropped fields (``CK313``) under ``$.domains[i].manifest``.

    Raises:
        InvalidInput: the index is invalid (its findings, as ``validate`` gives them).
        MigrationError: ``CK311`` when a domain's manifest cannot reach the target,
            ``CK312`` when the migrated index is not valid.
    """
    target = version_key(to_version)
    before = validate_index_document(doc)
    if has_errors(before.findings):
        raise InvalidInput(name, before.findings)
    result = copy.deepcopy(doc)
    steps: list[tuple[str, str]] = []
    findings = [f for f in before.findings if f.severity == "warning"]
    for i, domain in enumerate(result["domains"]):
        migrated = migrate_document(domain["manifest"], target, f"{name}: $.domains[{i}].manifest")
        domain["manifest"] = migrated.document
        steps += [step for step in migrated.steps if step not in steps]
        findings += [_in_domain(f, i) for f in migrated.findings if _in_domain(f, i) not in findings]
    after = validate_index_document(result)
    errors = [f for f in after.findings if f.severity == "error"]
    if errors:
        raise MigrationError(
            "CK312",
            f"the migrated checkpoint index is not valid: {errors[0].path}: {errors[0].code} {errors[0].message}",
            "this is a bug in ckptspec; the output was not written",
            name,
        )
    return MigrationResult(result, steps, findings)


def domain_versions(doc: Any) -> list[str]:
    """The distinct ``format_version`` of an index's domain manifests, in domain order."""
    versions: list[str] = []
    for domain in doc.get("domains", []) if isinstance(doc, dict) else []:
        version = domain.get("manifest", {}).get("format_version") if isinstance(domain, dict) else None
        if isinstance(version, str) and version not in versions:
            versions.append(version)
    return versions


__all__ = ["domain_versions", "migrate_index"]
