"""Migrate a checkpoint index: its own version (``ckptspec.checkpoint`` 1.0 <-> 1.1) and the
``ckptspec.manifest`` of each of its domains.

The index's schema takes any 1.x manifest as a domain's ``manifest`` (docs/spec-checkpoint.md#domains),
and each keeps its own version (docs/versioning.md). Migrating an index to ``V`` migrates every domain's
manifest to ``V`` with the registered migrations (``migrate.py``), and the index itself: 1.0 -> 1.1 is a
version bump (``extras`` stays absent: not described, a reader derives them from the files as for 1.0;
``ckptspec generate`` writes them), 1.1 -> 1.0 drops what 1.1 added (``extras``, ``aliases``, the shards'
``locator``), each outermost one reported as CK313. The index is validated whole before (an invalid
one: ``InvalidInput``) and after (``CK312``: nothing is handed out that its reader would refuse).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..errors import InvalidInput, MigrationError
from ..findings import Finding, finding, has_errors, json_path
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
    own = version_key(result["format_version"])
    findings += _index_version(result, target)
    if version_key(result["format_version"]) != own and (own, target) not in steps:
        steps.append((own, target))
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


INDEX_LINES = {"1.0": "1.0.0", "1.1": "1.1.0"}


def _index_version(doc: dict, target: str) -> list[Finding]:
    """The index's own version to ``target``'s line (in place); CK313 for each field 1.0 has no place for."""
    if target not in INDEX_LINES or version_key(doc["format_version"]) == target:
        return []
    dropped: list[str] = []
    if target == "1.0":
        dropped += [json_path(key) for key in ("extras", "aliases") if doc.pop(key, None) is not None]
        for i, param in enumerate(doc["parameters"]):
            for j, shard in enumerate(param["shards"]):
                if shard.pop("locator", None) is not None:
                    dropped.append(json_path("parameters", i, "shards", j, "locator"))
    doc["format_version"] = INDEX_LINES[target]
    return [
        finding(
            "CK313",
            where,
            f"checkpoint index {target} has no place for this field; the migration dropped it",
            "keep the original document if you need the field",
            severity="warning",
        )
        for where in dropped
    ]


def domain_versions(doc: Any) -> list[str]:
    """The distinct ``format_version`` of an index's domain manifests, in domain order."""
    versions: list[str] = []
    for domain in doc.get("domains", []) if isinstance(doc, dict) else []:
        version = domain.get("manifest", {}).get("format_version") if isinstance(domain, dict) else None
        if isinstance(version, str) and version not in versions:
            versions.append(version)
    return versions


__all__ = ["domain_versions", "migrate_index"]
